"""The batch triad: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* world_size. Any two give the third; one alone derives the rest upstream's way (no accumulation).
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import ConfigError

TB, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
TRIAD = (TB, MICRO, GAS)
FORMULA = f"{TB} = {MICRO} * {GAS} * world_size"


class BatchSizes(NamedTuple):
    train_batch_size: int
    micro: int  # train_micro_batch_size_per_gpu
    gas: int  # gradient_accumulation_steps


def derive(tb: int | None, micro: int | None, gas: int | None, ws: int) -> BatchSizes | None:
    """The full triad from the given values, or None when they cannot fit this world size."""
    if micro is None and tb is None:
        return None
    if micro is None:
        assert tb is not None
        g = gas or 1  # upstream: train_batch_size alone means no accumulation
        return BatchSizes(tb, tb // (g * ws), g) if tb % (g * ws) == 0 else None
    if tb is None:
        return BatchSizes(micro * (gas or 1) * ws, micro, gas or 1)
    if gas is None:
        return BatchSizes(tb, micro, tb // (micro * ws)) if tb % (micro * ws) == 0 else None
    return BatchSizes(tb, micro, gas) if tb == micro * gas * ws else None


def resolve(
    tb: int | None, micro: int | None, gas: int | None, world_size: int, source: str
) -> BatchSizes:
    """The three batch sizes for this world size, or a ConfigError that says how to fix them."""
    ws = world_size
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise ConfigError(f"world_size must be a positive integer, got {ws!r} (from {source})")
    sizes = derive(tb, micro, gas, ws)
    if sizes is not None:
        return sizes
    raise ConfigError(_report(tb, micro, gas, ws, source))


def _why(tb: int | None, micro: int | None, gas: int | None, ws: int) -> str:
    if tb is None and micro is None:
        alone = f" ({GAS}={gas} alone is not enough)" if gas is not None else ""
        return f"but neither {TB} nor {MICRO} is set{alone}"
    assert tb is not None
    if micro is not None and gas is not None:
        return f"but {micro} * {gas} * {ws} = {micro * gas * ws}, not {tb}"
    if micro is not None:
        return f"but {tb} is not divisible by {MICRO} * world_size = {micro} * {ws}"
    if gas is not None:
        return f"but {tb} is not divisible by {GAS} * world_size = {gas} * {ws}"
    return f"but {tb} is not divisible by world_size = {ws}"


def _report(tb: int | None, micro: int | None, gas: int | None, ws: int, source: str) -> str:
    given = ", ".join(
        f"{name}={'unset' if v is None else v}"
        for name, v in ((TB, tb), (MICRO, micro), (GAS, gas))
    )
    lines = [
        "the batch sizes do not fit the world size",
        f"given: {given}; world_size={ws} (from {source})",
        f"rule: {FORMULA}, {_why(tb, micro, gas, ws)}",
    ]
    lines += [f"fix {i}: {fix}" for i, fix in enumerate(fixes(tb, micro, gas, ws)[:2], 1)]
    return "\n    ".join(lines)


def _candidates(
    tb: int | None, micro: int | None, gas: int | None, ws: int
) -> list[tuple[BatchSizes, str]]:
    """Consistent triads close to what was given, the least change first."""
    out: list[tuple[BatchSizes, str]] = []
    if micro is not None and gas is not None:  # keep both; the total follows
        kept = f"keeps {MICRO}={micro} and {GAS}={gas}"
        out.append((BatchSizes(micro * gas * ws, micro, gas), kept))
    if tb is None:
        return out
    if tb % ws == 0:  # keep the total; split each rank's share another way
        share = tb // ws
        if gas is not None and share % gas == 0:
            m = share // gas
        else:  # the largest micro batch up to the given one that divides the share
            m = next(d for d in range(min(micro or share, share), 0, -1) if share % d == 0)
        out.append((BatchSizes(tb, m, share // m), f"keeps {TB}={tb}"))
    # The nearest totals that split evenly, keeping the micro batch, the accumulation, or neither.
    splits: list[tuple[int, int | None, int, str]] = []
    if micro is not None:
        splits.append((micro * ws, micro, 1, f"keeps {MICRO}={micro}"))
    if gas is not None:
        splits.append((gas * ws, None, gas, f"keeps {GAS}={gas}"))
    splits.append((ws, None, 1, f"the nearest {TB} for world_size {ws}"))
    for unit, keep_micro, acc, why in splits:
        low = tb // unit * unit
        for total in sorted((low, low + unit, low + 2 * unit), key=lambda t: abs(t - tb)):
            if total > 0:
                mb = keep_micro if keep_micro is not None else total // (acc * ws)
                out.append((BatchSizes(total, mb, total // (mb * ws)), why))
    return out


def fixes(tb: int | None, micro: int | None, gas: int | None, ws: int) -> list[str]:
    """Distinct consistent alternatives (at least two), as the keys to set, with arithmetic."""
    given = (tb, micro, gas)
    if tb is None and micro is None:  # nothing to keep: the two simplest starting points
        g = gas or 1
        picks = [
            (BatchSizes(ws * g, 1, g), "one sample per rank"),
            (BatchSizes(8 * ws * g, 8, g), ""),
        ]
        return [_describe(s, given, why, ws) for s, why in picks]
    current = derive(tb, micro, gas, ws)  # a fix must change something
    out: list[str] = []
    seen: set[BatchSizes] = set()
    for sizes, why in _candidates(tb, micro, gas, ws):
        if sizes not in seen and sizes != current and sizes.micro >= 1 and sizes.gas >= 1:
            seen.add(sizes)
            out.append(_describe(sizes, given, why, ws))
    return out


def _describe(
    sizes: BatchSizes, given: tuple[int | None, int | None, int | None], why: str, ws: int
) -> str:
    """The keys to set so that the config resolves to `sizes`: the wrong given ones, then any
    missing ones the derivation needs."""
    names = TRIAD
    values = list(given)
    to_set = {}
    for i, name in enumerate(names):
        if values[i] is not None and values[i] != sizes[i]:
            values[i] = to_set[name] = sizes[i]
    for i in (1, 2, 0):  # add micro, then accumulation, then the total, until it resolves
        if derive(values[0], values[1], values[2], ws) == sizes:
            break
        if values[i] is None:
            values[i] = to_set[names[i]] = sizes[i]
    keys = ", ".join(f'"{k}": {v}' for k, v in to_set.items())
    arithmetic = f"{sizes.micro} * {sizes.gas} * {ws} = {sizes.train_batch_size}"
    return f"set {keys} ({why + '; ' if why else ''}{arithmetic})"

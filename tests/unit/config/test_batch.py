"""The batch triad: every way of giving it, and what the error says when it cannot fit."""

import itertools
import re

import pytest

from deepspeed_ext.config import BatchSizes, ConfigError, parse
from deepspeed_ext.config.batch import FORMULA, derive, fixes

TB, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _resolve(ws, source="--world_size", **given):
    return parse(given).resolve_batch(ws, source)


@pytest.mark.parametrize(
    "given, ws, expected",
    [
        ({TB: 32, MICRO: 4, GAS: 4}, 2, (32, 4, 4)),  # all three, consistent
        ({TB: 32, MICRO: 4}, 2, (32, 4, 4)),  # accumulation derived
        ({TB: 32, GAS: 4}, 2, (32, 4, 4)),  # micro batch derived
        ({MICRO: 4, GAS: 4}, 2, (32, 4, 4)),  # total derived
        ({TB: 32}, 2, (32, 16, 1)),  # total alone: no accumulation (upstream)
        ({MICRO: 4}, 2, (8, 4, 1)),  # micro alone: no accumulation (upstream)
        ({TB: 8}, 1, (8, 8, 1)),
    ],
)
def test_derivations(given, ws, expected):
    sizes = _resolve(ws, **given)
    assert sizes == BatchSizes(*expected)
    assert (sizes.train_batch_size, sizes.micro, sizes.gas) == expected


def _error(ws, source, **given):
    with pytest.raises(ConfigError) as e:
        _resolve(ws, source, **given)
    return str(e.value)


def _fix_lines(msg):
    return [line.strip() for line in msg.splitlines() if line.strip().startswith("fix ")]


def _apply(given, fix_line):
    """The config after a fix: its keys set."""
    out = dict(given)
    for key, value in re.findall(r'"(\w+)": (\d+)', fix_line.split("(")[0]):
        out[key] = int(value)
    return out


def _check_message(msg, given, ws, source):
    for key in (TB, MICRO, GAS):
        shown = given.get(key, "unset")
        assert f"{key}={shown}" in msg
    assert f"world_size={ws}" in msg and source in msg
    assert FORMULA in msg
    lines = _fix_lines(msg)
    assert len(lines) == 2
    for line in lines:  # both fixes are consistent for this world size and give concrete numbers
        fixed = _apply(given, line)
        assert fixed != given
        assert derive(fixed.get(TB), fixed.get(MICRO), fixed.get(GAS), ws) is not None, line


def test_mismatch_names_values_world_size_source_formula_and_two_fixes():
    given = {TB: 32, MICRO: 4, GAS: 2}
    msg = _error(2, "--num_gpus 2 on the launcher", **given)
    assert "4 * 2 * 2 = 16, not 32" in msg
    _check_message(msg, given, 2, "--num_gpus 2 on the launcher")
    assert 'fix 1: set "train_batch_size": 16' in msg
    assert 'fix 2: set "train_micro_batch_size_per_gpu": 8' in msg


@pytest.mark.parametrize(
    "given, ws, why",
    [
        (
            {TB: 30, MICRO: 4},
            2,
            "30 is not divisible by train_micro_batch_size_per_gpu * world_size",
        ),
        ({TB: 30, GAS: 4}, 2, "30 is not divisible by gradient_accumulation_steps * world_size"),
        ({TB: 10}, 4, "10 is not divisible by world_size = 4"),
        ({TB: 32, MICRO: 4, GAS: 4}, 3, "4 * 4 * 3 = 48, not 32"),
    ],
)
def test_not_divisible(given, ws, why):
    msg = _error(ws, "WORLD_SIZE env", **given)
    assert why in msg
    _check_message(msg, given, ws, "WORLD_SIZE env")


@pytest.mark.parametrize("given", [{}, {GAS: 4}])
def test_neither_total_nor_micro_is_an_error(given):
    msg = _error(2, "--world_size", **given)
    assert f"neither {TB} nor {MICRO} is set" in msg
    _check_message(msg, given, 2, "--world_size")


def test_fixes_are_always_consistent():
    """Every fix offered, over a grid of inconsistent inputs, resolves for its world size."""
    values = [None, 1, 3, 4, 7, 32]
    for tb, micro, gas, ws in itertools.product(values, values, [None, 1, 2, 3], [1, 2, 3, 8]):
        if derive(tb, micro, gas, ws) is not None:
            continue
        found = fixes(tb, micro, gas, ws)
        assert len(found) >= 2, (tb, micro, gas, ws)
        given = {k: v for k, v in zip((TB, MICRO, GAS), (tb, micro, gas)) if v is not None}
        for fix in found:
            fixed = _apply(given, fix)
            assert derive(fixed.get(TB), fixed.get(MICRO), fixed.get(GAS), ws), (given, ws, fix)


def test_bad_world_size():
    with pytest.raises(ConfigError, match="world_size must be a positive integer"):
        _resolve(0, **{TB: 8})


def test_batch_values_must_be_positive():
    with pytest.raises(ConfigError, match="train_batch_size: expected a value greater than 0"):
        parse({TB: 0})

"""Upstream's deprecated and alternative key names, rewritten to the canonical keys.

Each deprecated spelling gives one warning naming its replacement; an alternative spelling
that upstream accepts as an equal (zero's short names without "stage3_") is mapped silently.
Giving the old and the new key together is an error: which one should win is not obvious.

Where upstream has them: bfloat16 (runtime/precision_config.py BFLOAT16_OLD), a boolean
zero_optimization and allgather_size (runtime/zero/config.py read_zero_config_deprecated),
cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory /
stage3_gather_fp16_weights_on_model_save and the short ZeRO names (runtime/zero/config.py),
tp / kernel_inject (runtime/tensor_parallel/config.py). Renamed upstream without an alias, kept
here so older configs still work: seq_parallel_comm_data_type (runtime/constants.py) and
aio.thread_count (PR #7056); "quantize-algo" is the spelling of upstream's MoQ tutorial.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .schema import join

Convert = Callable[[Any], Any]


@dataclass(frozen=True)
class Rename:
    section: str  # dotted path of the object holding the key ("" = top level)
    old: str
    new: str  # dotted path, relative to the top level when it contains a dot
    deprecated: bool = True  # False: an equal alternative upstream accepts silently
    convert: Convert | None = None
    how: str = ""  # how the value is carried over, for the warning

    def new_path(self) -> str:
        return self.new if "." in self.new else join(self.section, self.new)


def _to_offload(old: str) -> Convert:
    def convert(v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError(f"{old}: expected a boolean (true or false), got {v!r}")
        return {"device": "cpu"} if v else None

    return convert


_ZERO = "zero_optimization"
# Upstream's ZeRO model names these fields without "stage3_" and accepts both spellings.
_ZERO_SHORT = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)

RENAMES: tuple[Rename, ...] = (
    Rename("", "bfloat16", "bf16"),
    Rename("", "allgather_size", f"{_ZERO}.allgather_bucket_size"),
    Rename("", "seq_parallel_comm_data_type", "seq_parallel_communication_data_type"),
    Rename(
        _ZERO,
        "cpu_offload",
        "offload_optimizer",
        convert=_to_offload(f"{_ZERO}.cpu_offload"),
        how='true becomes {"device": "cpu"}',
    ),
    Rename(
        _ZERO,
        "cpu_offload_param",
        "offload_param",
        convert=_to_offload(f"{_ZERO}.cpu_offload_param"),
        how='true becomes {"device": "cpu"}',
    ),
    Rename(
        _ZERO,
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
    ),
    *(Rename(_ZERO, short, f"stage3_{short}", deprecated=False) for short in _ZERO_SHORT),
    # the plural spelling widely read guides use
    Rename(_ZERO, "offload_params", "offload_param", deprecated=False),
    Rename("aio", "thread_count", "intra_op_parallelism"),
    Rename("tensor_parallel", "tensor_parallel", "tp", deprecated=False),
    # printed by widely read guides (Megatron's name); upstream does not accept it
    Rename("", "tensor_model_parallel_size", "tensor_parallel.autotp_size", deprecated=False),
    Rename("tensor_parallel", "kernel_inject", "replace_with_kernel_inject", deprecated=False),
    Rename("quantize_training", "quantize-algo", "quantize_algo", deprecated=False),
)


@dataclass
class Rewrite:
    data: dict[str, Any]
    warnings: list[str]
    errors: list[str]


def _node(data: dict[str, Any], path: str, create: bool = False) -> dict[str, Any] | None:
    """The object at a dotted path (made when `create`), or None when something else is there."""
    node: Any = data
    for part in path.split(".") if path else []:
        if not isinstance(node, dict):
            return None
        if create:
            node.setdefault(part, {})
        node = node.get(part)
    return node if isinstance(node, dict) else None


def _deprecated(old: str, new: str, how: str = "") -> str:
    return f'"{old}" is deprecated; use "{new}" instead' + (f" ({how})" if how else "")


def rewrite(raw: dict[str, Any]) -> Rewrite:
    """A deep copy of `raw` with every alias replaced by its canonical key."""
    out = Rewrite(copy.deepcopy(raw), [], [])
    _zero_as_boolean(out)
    for rule in RENAMES:
        _apply(rule, out)
    _pin_memory(out)
    return out


def _apply(rule: Rename, out: Rewrite) -> None:
    holder = _node(out.data, rule.section)
    if holder is None or rule.old not in holder:
        return
    old_path, new_path = join(rule.section, rule.old), rule.new_path()
    *parents, last = new_path.split(".")
    target = _node(out.data, ".".join(parents), create=True)
    if target is None:  # the destination is not an object: its own type error says so
        holder.pop(rule.old)
        return
    if last in target:
        out.errors.append(f'"{old_path}" and "{new_path}" are both given; keep only "{new_path}"')
        holder.pop(rule.old)  # said once: not also an unknown key
        return
    value = holder.pop(rule.old)
    if rule.convert is not None:
        try:
            value = rule.convert(value)
        except ValueError as e:
            out.errors.append(str(e))
            return
    if value is not None:
        target[last] = value
    if rule.deprecated:
        out.warnings.append(_deprecated(old_path, new_path, rule.how))


def _zero_as_boolean(out: Rewrite) -> None:
    """Upstream's oldest form, "zero_optimization": true, meant stage 1."""
    value = out.data.get(_ZERO)
    if isinstance(value, bool):
        out.data[_ZERO] = {"stage": 1 if value else 0}
        stage = 1 if value else 0
        out.warnings.append(
            f'a boolean "{_ZERO}" is deprecated; use "{_ZERO}": {{"stage": {stage}}} instead'
        )


def _pin_memory(out: Rewrite) -> None:
    """cpu_offload_use_pin_memory: the pin_memory of the offload sections that do not set it."""
    key = "cpu_offload_use_pin_memory"
    zero = _node(out.data, _ZERO)
    if zero is None or key not in zero:
        return
    value = zero.pop(key)
    if not isinstance(value, bool):
        out.errors.append(f"{_ZERO}.{key}: expected a boolean (true or false), got {value!r}")
        return
    for section in ("offload_optimizer", "offload_param"):
        sub = zero.get(section)
        if isinstance(sub, dict):
            sub.setdefault("pin_memory", value)
    new = f"{_ZERO}.offload_optimizer.pin_memory / {_ZERO}.offload_param.pin_memory"
    out.warnings.append(_deprecated(f"{_ZERO}.{key}", new))

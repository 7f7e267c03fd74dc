"""Command-line flags for the schedules (upstream's `deepspeed.add_tuning_arguments`) and the
scheduler config they turn into."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from .constants import (
    CYCLE_MAX_LR,
    LR_RANGE_TEST,
    LR_RANGE_TEST_MIN_LR,
    ONE_CYCLE,
    VALID_LR_SCHEDULES,
    WARMUP_COSINE_LR,
    WARMUP_LOG_RATE,
    WARMUP_MAX_LR,
)

# (flag, type, default, help); defaults are upstream's flag defaults, not the constructors'.
_RANGE_TEST_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("lr_range_test_min_lr", float, 0.001, "starting lr"),
    ("lr_range_test_step_rate", float, 1.0, "lr growth rate per interval"),
    ("lr_range_test_step_size", int, 1000, "training steps per lr interval"),
    ("lr_range_test_staircase", bool, False, "grow in stairs instead of continuously"),
]
_ONE_CYCLE_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("cycle_first_step_size", int, 1000, "steps in the rising half of the cycle"),
    ("cycle_first_stair_count", int, -1, "stairs in the rising half"),
    ("cycle_second_step_size", int, -1, "steps in the falling half"),
    ("cycle_second_stair_count", int, -1, "stairs in the falling half"),
    ("decay_step_size", int, 1000, "steps per decay interval after the cycle"),
    ("cycle_min_lr", float, 0.01, "cycle lr floor"),
    ("cycle_max_lr", float, 0.1, "cycle lr peak"),
    ("decay_lr_rate", float, 0.0, "lr decay rate after the cycle"),
    ("cycle_min_mom", float, 0.8, "cycle momentum floor"),
    ("cycle_max_mom", float, 0.9, "cycle momentum peak"),
    ("decay_mom_rate", float, 0.0, "momentum decay rate after the cycle"),
]
_WARMUP_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("warmup_min_lr", float, 0, "lr at the start of warmup"),
    ("warmup_max_lr", float, 0.001, "lr at the end of warmup"),
    ("warmup_num_steps", int, 1000, "warmup length in steps"),
    ("warmup_type", str, WARMUP_LOG_RATE, "warmup curve: log or linear"),
]
_COSINE_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("warmup_min_ratio", float, 0.01, "WarmupCosineLR start ratio"),
    ("cos_min_ratio", float, 0.01, "WarmupCosineLR end ratio"),
]
_ALL_FLAGS = _RANGE_TEST_FLAGS + _ONE_CYCLE_FLAGS + _WARMUP_FLAGS + _COSINE_FLAGS


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training")
    for flag, kind, default, text in _ALL_FLAGS:
        group.add_argument(f"--{flag}", type=kind, default=default, help=text)
    group.add_argument(
        "--cycle_momentum", default=False, action="store_true", help="cycle momentum too"
    )
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def _copy(args: argparse.Namespace, flags: list[tuple[str, Any, Any, str]], params: dict) -> None:
    for flag, *_ in flags:
        value = getattr(args, flag, None)
        if value is not None:
            params[flag] = value


def override_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Copy every schedule flag set on `args` into `params` (upstream's catch-all)."""
    for flags in (_RANGE_TEST_FLAGS, _ONE_CYCLE_FLAGS, _WARMUP_FLAGS):
        _copy(args, flags, params)


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """(scheduler config, None) from the flags, or (None, why not)."""
    name = getattr(args, "lr_schedule", None)
    if name is None:
        return None, "--lr_schedule not specified on command line"
    if name not in VALID_LR_SCHEDULES:
        return None, f"{name} is not supported LR schedule"
    params: dict[str, Any] = {}
    if name == LR_RANGE_TEST:
        _copy(args, _RANGE_TEST_FLAGS, params)
    elif name == ONE_CYCLE:
        _copy(args, _ONE_CYCLE_FLAGS, params)
    elif name == WARMUP_COSINE_LR:
        # Only the flags its constructor takes (upstream passes WarmupLR's, which it rejects).
        _copy(args, _COSINE_FLAGS + _WARMUP_FLAGS[2:], params)
    else:
        _copy(args, _WARMUP_FLAGS, params)
    return {"type": name, "params": params}, None


def get_lr_from_config(config: Mapping[str, Any]) -> tuple[float | None, str]:
    """The lr a scheduler config names (range-test floor, cycle peak or warmup peak)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    name, params = config["type"], config["params"]
    if name not in VALID_LR_SCHEDULES:
        return None, f"{name} is not a valid LR schedule"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(name, WARMUP_MAX_LR)
    if key not in params:
        return None, f"{name} params have no {key}"
    return params[key], ""

"""`scheduler`: which learning-rate schedule the engine builds, and its arguments."""

from __future__ import annotations

from ..types import EMPTY, FreeDict, Section, Str


class SchedulerConfig(Section):
    # None: the client passes its own scheduler (or none).
    type: Str | None = None
    # Passed to the scheduler's constructor as keyword arguments; read-only.
    params: FreeDict = EMPTY

    def active(self) -> bool:
        return self.type is not None


# DeepSpeed's own schedules and their constructor params after the optimizer: (required,
# optional). Kept here, without torch, so the launcher's pre-flight can check them; a test
# holds it equal to the constructors' signatures.
SCHEDULE_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "LRRangeTest": (
        (),
        (
            "lr_range_test_min_lr",
            "lr_range_test_step_size",
            "lr_range_test_step_rate",
            "lr_range_test_staircase",
            "last_batch_iteration",
        ),
    ),
    "OneCycle": (
        ("cycle_min_lr", "cycle_max_lr"),
        (
            "decay_lr_rate",
            "cycle_first_step_size",
            "cycle_second_step_size",
            "cycle_first_stair_count",
            "cycle_second_stair_count",
            "decay_step_size",
            "cycle_momentum",
            "cycle_min_mom",
            "cycle_max_mom",
            "decay_mom_rate",
            "last_batch_iteration",
        ),
    ),
    "WarmupLR": (
        (),
        (
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ),
    ),
    "WarmupDecayLR": (
        ("total_num_steps",),
        (
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ),
    ),
    "WarmupCosineLR": (
        ("total_num_steps",),
        (
            "warmup_min_ratio",
            "warmup_num_steps",
            "cos_min_ratio",
            "warmup_type",
            "last_batch_iteration",
        ),
    ),
}

# Step counts the schedules take as upstream does, only as a Python int of 1 or more (upstream
# refuses 0, negatives, 10.0 and None alike). Checked at config parse and in the constructors.
STEP_COUNT_PARAMS: dict[str, tuple[str, ...]] = {
    "LRRangeTest": ("lr_range_test_step_size",),
    "WarmupLR": ("warmup_num_steps",),
    "WarmupDecayLR": ("warmup_num_steps",),
    "WarmupCosineLR": ("warmup_num_steps",),
}


def step_count_problem(name: str, value: object) -> str | None:
    """Why `value` is not a step count for param `name` (an int of 1 or more), or None."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return None
    if isinstance(value, float) and value.is_integer() and value > 0:
        fix = f"write {int(value)}, without the decimal point"
    elif value is None:
        fix = "give a whole number of steps, or leave it out for the default"
    else:
        fix = "give a whole number of steps, 1 or more"
    return f"{name} must be a positive integer, got {value!r}: {fix}"

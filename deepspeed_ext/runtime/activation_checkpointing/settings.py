"""What deepspeed.checkpointing.configure() set: upstream's arguments over the config's
`activation_checkpointing` section, checked when configured (not at the first recompute)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepspeed_ext.comm import layout
from deepspeed_ext.comm.layout import AxisGroup
from deepspeed_ext.config.errors import ConfigError
from deepspeed_ext.utils.logging import logger

_SECTION = "activation_checkpointing"


@dataclass
class Settings:
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: Any = None
    configured: bool = False
    by_engine: bool = False  # set from an engine's config, not by the user's configure()
    # profile: seconds spent in checkpointed forwards and in their recomputes, and counts
    times: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "recompute": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "recompute": 0})


_current = Settings()


def current() -> Settings:
    return _current


def _section(deepspeed_config: Any) -> dict[str, Any]:
    """The activation_checkpointing section of a config (path, dict, DeepSpeedConfig),
    validated as the engine validates it: a misspelt key is an error naming it."""
    cfg = deepspeed_config
    if not hasattr(cfg, "activation_checkpointing"):
        from deepspeed_ext.config import parse

        cfg = parse(cfg)
    section = cfg.activation_checkpointing
    return {k: getattr(section, k) for k in type(section).model_fields}


def tensor_axis(mpu: Any) -> AxisGroup:
    """The tensor-parallel group saved activations are split across: the mpu's (its
    tensor-model-parallel group, else its model-parallel group), else the layout's (AutoTP)."""
    if mpu is not None:
        for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
            if hasattr(mpu, name):
                return layout.axis_of(getattr(mpu, name)())
    return layout.current().tensor


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Upstream's signature: defaults, then the config section, then the arguments given."""
    global _current
    s = Settings(mpu=mpu_ if mpu_ is not None else _current.mpu, configured=True)
    from_section = {}
    if deepspeed_config is not None:
        from_section = _section(deepspeed_config)
        for k, v in from_section.items():
            if hasattr(s, k):
                setattr(s, k, v)
    given = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for k, v in given.items():
        if v is not None:
            setattr(s, k, v)
    _check(s)
    if from_section.get("number_checkpoints") is not None and num_checkpoints is None:
        if not s.contiguous_memory_optimization:  # Megatron passes it always: only the key's
            logger.warning(
                f"{_SECTION}.number_checkpoints has no effect without "
                "contiguous_memory_optimization (it sizes that buffer's slots); remove it"
            )
    _current = s
    logger.debug(
        f"activation checkpointing: cpu_checkpointing={s.cpu_checkpointing}, "
        f"synchronize={s.synchronize_checkpoint_boundary}, profile={s.profile}"
    )


def _check(s: Settings) -> None:
    key = f"{_SECTION}.partition_activations"
    if s.partition_activations:
        if tensor_axis(s.mpu).size <= 1:
            raise ConfigError(
                f"{key} is true but there is no tensor-parallel group of 2 or more ranks to "
                "split saved activations across (pass an mpu with one to configure()); set it "
                "false, or use cpu_checkpointing to move them off the device instead"
            )
    if s.contiguous_memory_optimization and not s.number_checkpoints:
        raise ConfigError(
            f"{_SECTION}.contiguous_memory_optimization preallocates one slot per checkpoint: "
            "set number_checkpoints (the checkpointed blocks per forward)"
        )
    if s.contiguous_memory_optimization and not s.partition_activations:
        raise ConfigError(
            f"{_SECTION}.contiguous_memory_optimization keeps partitioned activations in one "
            "buffer: it needs partition_activations true; set both, or neither"
        )
    if s.number_checkpoints is not None and s.number_checkpoints < 1:
        raise ConfigError(
            f"{_SECTION}.number_checkpoints must be 1 or more, got {s.number_checkpoints}"
        )


def configure_for_engine(config: Any, mpu: Any) -> None:
    """deepspeed.initialize applies the config's activation_checkpointing section to
    deepspeed.checkpointing (upstream leaves that to model code, so a section set without
    a configure() call does nothing there), unless the user configured it themselves."""
    if _current.configured and not _current.by_engine:
        _say_overridden(config)
        return
    configure(mpu, deepspeed_config=config)
    _current.by_engine = True


def _say_overridden(config: Any) -> None:
    """The section's keys that the user's earlier configure() left at other values: said,
    not dropped unsaid."""
    section = config.activation_checkpointing
    fields = type(section).model_fields
    differ = [
        f"{_SECTION}.{k}={getattr(section, k)!r} (in effect: {getattr(_current, k)!r})"
        for k in fields
        if hasattr(_current, k)
        and getattr(section, k) != fields[k].get_default(call_default_factory=True)
        and getattr(section, k) != getattr(_current, k)
    ]
    if differ:
        logger.warning(
            "deepspeed.checkpointing.configure() ran before deepspeed.initialize and its "
            f"settings stand: {', '.join(differ)}; pass deepspeed_config= to configure() (or "
            "the same values) to apply the config's section"
        )


def is_configured() -> bool:
    return _current.configured


def reset() -> None:
    """Frees the contiguous buffers (for evaluation passes that never run the backward) and
    restarts the profile counters."""
    from . import partition  # it reads these settings

    partition.free_buffers()
    _restart_counters()


def _restart_counters() -> None:
    _current.times = {"forward": 0.0, "recompute": 0.0}
    _current.calls = {"forward": 0, "recompute": 0}


def take_profile_ms() -> dict[str, float]:
    """profile: milliseconds in checkpointed forwards and in recomputes since the last call
    (the metrics line shows them as `ckpt forward` and `ckpt recompute`); {} when off."""
    if not _current.profile:
        return {}
    out = {f"ckpt_{k}_ms": 1000 * v for k, v in _current.times.items()}
    _restart_counters()
    return out


def set_num_layers(nlayers: int) -> None:
    """Upstream's name for number_checkpoints."""
    _current.number_checkpoints = nlayers
    _check(_current)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    _current.partition_activations = bool(partition_activation)
    try:
        _check(_current)
    except ConfigError:
        _current.partition_activations = False
        raise

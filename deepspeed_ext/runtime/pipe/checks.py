"""What a pipeline run refuses before any collective: config keys that disagree with the
PipelineModule, an mpu beside the module's own grid (ZeRO stage 3 runs as stage 2:
[Note: stage 3 under model parallelism])."""

from __future__ import annotations

from typing import Any

from .module import DEFAULT_CHECKPOINTS, PipelineModule


def check_pipeline_config(config: Any, module: PipelineModule, mpu: Any) -> None:
    if mpu is not None and mpu is not module.mpu():
        raise ValueError(
            "deepspeed.initialize(mpu=...) with a PipelineModule: the module's topology "
            "already defines the parallel layout; drop mpu= (or build the PipelineModule "
            "with topology= matching it)"
        )
    schedule_for(config, module)
    if int(config.zero_optimization.stage) >= 3:  # initialize runs it as stage 2
        raise ValueError(
            "zero_optimization.stage 3 reached the pipeline engine: deepspeed.initialize "
            "runs it as stage 2 with a PipelineModule; build the engine through it"
        )
    pipe = config.pipeline
    given = pipe.model_fields_set
    if "stages" in given and pipe.stages != "auto" and int(pipe.stages) != module.num_stages:
        raise ValueError(
            f"pipeline.stages is {pipe.stages} but the PipelineModule has "
            f'{module.num_stages} stages: make them agree, or set pipeline.stages to "auto"'
        )
    ours = {
        "partition": _partition_name(module.partition_method),
        "seed_layers": module.seed_layers,
        "activation_checkpoint_interval": module.activation_checkpoint_interval,
    }
    _use_reentrant(pipe.use_reentrant, module)
    for key, value in ours.items():
        if key not in given:
            continue
        want = getattr(pipe, key)
        same = _partition_name(want) == value if key == "partition" else want == value
        if not same:
            arg = {"partition": "partition_method"}.get(key, key)
            raise ValueError(
                f"pipeline.{key} is {want!r} but the PipelineModule was built with "
                f"{arg}={value!r}: the module's argument decides; drop pipeline.{key} "
                "or make them agree"
            )


def _use_reentrant(reentrant: bool | None, module: PipelineModule) -> None:
    """pipeline.use_reentrant picks the module's default checkpoint function (None: the
    non-reentrant one here; upstream's None means reentrant)."""
    if reentrant is None:
        return
    if module.activation_checkpoint_func not in DEFAULT_CHECKPOINTS.values():
        raise ValueError(
            f"pipeline.use_reentrant is {reentrant} but the PipelineModule was built with its "
            "own activation_checkpoint_func, which decides; drop pipeline.use_reentrant"
        )
    module.activation_checkpoint_func = DEFAULT_CHECKPOINTS[bool(reentrant)]


def _partition_name(method: Any) -> Any:
    if isinstance(method, (list, tuple)):
        return list(method)
    m = str(method).lower()
    return "parameters" if m == "best" else m


# pipeline.schedule's values that run a DualPipeVModule (its V of stages)
V_SCHEDULES = ("dualpipev", "dualpipev-zb")


def schedule_for(config: Any, module: PipelineModule) -> str:
    """pipeline.schedule against the module's virtual stages."""
    pipe = config.pipeline
    given = "schedule" in pipe.model_fields_set
    if module.pipe_layout == "v":
        if given and pipe.schedule not in V_SCHEDULES:
            raise ValueError(
                f"pipeline.schedule is {pipe.schedule!r} but the model is a DualPipeVModule, "
                "which runs the dualpipev schedule ('dualpipev-zb': its backwards split): "
                "drop pipeline.schedule, or build a PipelineModule"
            )
        return str(pipe.schedule) if given else "dualpipev"
    if given and pipe.schedule in V_SCHEDULES:
        raise ValueError(
            f"pipeline.schedule {pipe.schedule!r} needs the model laid out as a V: build it "
            "with deepspeed.pipe.DualPipeVModule (PipelineModule's arguments) instead of "
            "PipelineModule"
        )
    if module.virtual_stages > 1:
        if given and pipe.schedule != "interleaved":
            raise ValueError(
                f"pipeline.schedule is {pipe.schedule!r} but the PipelineModule was built "
                f"with virtual_stages={module.virtual_stages}, which runs the interleaved "
                "schedule: drop pipeline.schedule, or build it with virtual_stages=1"
            )
        return "interleaved"
    if given and pipe.schedule == "interleaved":
        raise ValueError(
            "pipeline.schedule 'interleaved' needs model chunks: build the PipelineModule "
            "with virtual_stages=2 (or more)"
        )
    return str(pipe.schedule)

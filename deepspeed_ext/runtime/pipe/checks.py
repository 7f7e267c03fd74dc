"""What a pipeline run refuses before any collective: config keys that disagree with the
PipelineModule (but pipeline.activation_checkpoint_interval, which sets it), an mpu beside
the module's own grid (ZeRO stage 3 runs as stage 2: [Note: stage 3 under model
parallelism])."""

from __future__ import annotations

from typing import Any

from deepspeed_ext.utils.logging import logger

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
    _checkpoint_interval(pipe, module)
    ours = {
        "partition": _partition_name(module.partition_method),
        "seed_layers": module.seed_layers,
    }
    _use_reentrant(pipe.use_reentrant, module, config.activation_checkpointing)
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


def _checkpoint_interval(pipe: Any, module: PipelineModule) -> None:
    """pipeline.activation_checkpoint_interval above 0 sets the module's, as upstream's engine
    does (a config from a guide turns checkpointing on without a code change); 0 given
    against a module that checkpoints is refused rather than ignored as upstream does."""
    if "activation_checkpoint_interval" not in pipe.model_fields_set:
        return
    want, built = int(pipe.activation_checkpoint_interval), module.activation_checkpoint_interval
    if want == built:
        return
    if want == 0:
        raise ValueError(
            "pipeline.activation_checkpoint_interval is 0 but the PipelineModule was built "
            f"with activation_checkpoint_interval={built}: drop the key to keep the module's, "
            "or build the module with 0 to turn checkpointing off"
        )
    if built:
        logger.info(
            f"pipeline.activation_checkpoint_interval={want} replaces the PipelineModule's "
            f"activation_checkpoint_interval={built}"
        )
    module.set_checkpoint_interval(want)


def _use_reentrant(reentrant: bool | None, module: PipelineModule, checkpointing: Any) -> None:
    """pipeline.use_reentrant picks the module's default checkpoint function (None: the
    non-reentrant one here unless partition_activations is on; upstream's None means
    reentrant)."""
    if reentrant is None:
        return
    if module.activation_checkpoint_func not in DEFAULT_CHECKPOINTS.values():
        raise ValueError(
            f"pipeline.use_reentrant is {reentrant} but the PipelineModule was built with its "
            "own activation_checkpoint_func, which decides; drop pipeline.use_reentrant"
        )
    if not reentrant and checkpointing.partition_activations:
        raise ValueError(
            "pipeline.use_reentrant is false but activation_checkpointing."
            "partition_activations is true: a non-reentrant checkpoint keeps its saved inputs "
            "whole, so they would not be partitioned; drop pipeline.use_reentrant (partitioned "
            "checkpoints run reentrant) or set partition_activations false"
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

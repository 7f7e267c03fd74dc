"""deepspeed.initialize: upstream's entry point and signature."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.config import parse
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.stage3.init import torch_constructors

from .engine import DeepSpeedEngine
from .model_parallel_zero import fallback_stage
from .pipe import DualPipeVEngine, DualPipeVModule, PipelineEngine, PipelineModule
from .pipe.wrap import as_pipeline


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """-> (engine, optimizer, training dataloader or None, lr scheduler or None).

    mpu: a Megatron-style object (get_data_parallel_group(), get_model_parallel_*(), ...) or
    a PipelineParallelGrid; data parallelism, ZeRO and batch sizes then run over its
    data-parallel group ([Note: parallel layout])."""
    with torch_constructors():  # torch's own, inside a zero.Init that changed them
        return _initialize(
            args,
            model,
            optimizer,
            model_parameters,
            training_data,
            lr_scheduler,
            distributed_port,
            mpu,
            dist_init_required,
            collate_fn,
            config,
            mesh_param,
            config_params,
        )


def _initialize(
    args: Any,
    model: torch.nn.Module | None,
    optimizer: Any,
    model_parameters: Any,
    training_data: Any,
    lr_scheduler: Any,
    distributed_port: int,
    mpu: Any,
    dist_init_required: bool | None,
    collate_fn: Any,
    config: Any,
    mesh_param: Any,
    config_params: Any,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    if model is None:
        raise ValueError("deepspeed.initialize needs model=<your torch.nn.Module>")
    if mesh_param is not None:
        raise ValueError(
            "deepspeed.initialize(mesh_param=...): device meshes (sequence/tensor parallel "
            "sizes) are not built yet; leave it out (data and pipeline parallelism need none)"
        )
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated: use --deepspeed_config")
        from_args = args.deepscale_config  # upstream's old flag, which add_config_arguments adds
    if config is None:
        config = config_params
    if from_args is not None and config is not None:
        raise ValueError(
            "two DeepSpeed configs were given: args.deepspeed_config and config=...; pass one"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "no DeepSpeed config: pass config=<dict or path> to deepspeed.initialize, or "
            "--deepspeed_config <path> on the command line"
        )
    parsed = parse(config)
    from deepspeed_ext import comm

    # before any engine: distributed_port is where a launcher-less start rendezvouses
    comm.init_distributed(
        dist_init_required=dist_init_required, distributed_port=distributed_port, verbose=False
    )
    pipelined = parsed.pipeline_parallelism.num_stages is not None or isinstance(
        model, PipelineModule
    )
    parsed = fallback_stage(parsed, pipelined)  # [Note: stage 3 under model parallelism]
    if pipelined:
        model = as_pipeline(model, parsed)
    engine_type: Any = DeepSpeedEngine
    if isinstance(model, PipelineModule):
        engine_type = DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine
    engine = engine_type(
        model=model,
        config=parsed,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        collate_fn=collate_fn,
        dist_init_required=dist_init_required,
        mpu=mpu,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: Any) -> Any:
    """Upstream's helper: adds --deepspeed, --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config) to an argparse parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config"
    )
    return parser


class DeepSpeedModel:
    """`deepspeed.pt_model.DeepSpeedModel(model, optimizer, config_file="ds_config.json")`:
    the call some guides use; it is initialize() returning the engine alone."""

    def __new__(  # type: ignore[misc]
        cls,
        model: torch.nn.Module,
        optimizer: Any = None,
        config_file: Any = None,
        config: Any = None,
        **kwargs: Any,
    ) -> DeepSpeedEngine:
        if config_file is not None and config is not None:
            raise ValueError("DeepSpeedModel: pass config_file= or config=, not both")
        engine, *_ = initialize(
            model=model, optimizer=optimizer, config=config_file or config, **kwargs
        )
        return engine

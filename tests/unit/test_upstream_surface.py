"""Upstream's public names that code imports (HF transformers/accelerate, PEFT/TRL-style
trainers, upstream's docs), each present at its upstream path, and what each does where it
needs no process group."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

SURFACE = {
    "deepspeed": [
        "DeepSpeedConfig",
        "DeepSpeedEngine",
        "DualPipeVEngine",  # upstream 0.19.8's DualPipeV
        "DualPipeVModule",
        "PipelineEngine",  # Megatron-DeepSpeed: isinstance(model, deepspeed.PipelineEngine)
        "PipelineModule",
        "add_config_arguments",
        "comm",
        "init_distributed",
        "initialize",
        "ops",
        "pipe",
        "zero",
    ],
    "deepspeed.pt_model": ["DeepSpeedModel"],
    "deepspeed.ops.sparse_attention": [
        "BSLongformerSparsityConfig",
        "BertSparseSelfAttention",
        "BigBirdSparsityConfig",
        "DenseSparsityConfig",
        "FixedSparsityConfig",
        "LocalSlidingWindowSparsityConfig",
        "MatMul",
        "Softmax",
        "SparseAttentionUtils",
        "SparseSelfAttention",
        "SparsityConfig",
        "VariableSparsityConfig",
    ],
    "deepspeed.ops.transformer": ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"],
    "deepspeed.runtime.fp16.onebit.adam": ["OnebitAdam"],
    "deepspeed.profiling.flops_profiler": ["FlopsProfiler", "get_model_profile"],
    "deepspeed.profiling.flops_profiler.profiler": ["FlopsProfiler", "get_model_profile"],
    "deepspeed.runtime.config": ["DeepSpeedConfig"],
    "deepspeed.runtime.zero.config": ["DeepSpeedZeroConfig", "ZeroStageEnum"],
    "deepspeed.runtime.zero.offload_config": [
        "DeepSpeedZeroOffloadOptimizerConfig",
        "DeepSpeedZeroOffloadParamConfig",
        "OffloadDeviceEnum",
    ],
    "deepspeed.runtime.utils": ["RepeatingLoader", "see_memory_usage"],
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine": ["CheckpointEngine"],
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": ["TorchCheckpointEngine"],
    "deepspeed.runtime.pipe.p2p": [
        "can_send_recv",
        "init_process_groups",
        "recv",
        "recv_obj",
        "send",
        "send_obj",
        "wait",
    ],
    "deepspeed.pipe": ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"],
    "deepspeed.runtime.pipe.dualpipev": ["DualPipeVEngine", "DualPipeVModule"],
    "deepspeed.runtime.pipe.schedule": [
        "CommitP2P",
        "DualPipeVSchedule",
        "InferenceSchedule",
        "TrainSchedule",
    ],
    "deepspeed.runtime.pipe.engine": [
        "BATCH_INPUT_TIMER",
        "DATA_PARALLEL_ID",
        "LOG_STAGE",
        "PIPE_RECV_GRAD_TIMER",
        "PIPE_RECV_INPUT_TIMER",
        "PIPE_SEND_GRAD_TIMER",
        "PIPE_SEND_OUTPUT_TIMER",
        "PipelineEngine",
        "TRAIN_BATCH_TIMER",
    ],
    "deepspeed.utils": [
        "groups",
        "log_dist",
        "logger",
        "safe_get_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
        "safe_get_local_fp32_param",
        "safe_get_local_grad",
        "safe_get_local_optimizer_state",
        "safe_set_full_fp32_param",
        "safe_set_full_optimizer_state",
        "safe_set_local_fp32_param",
        "safe_set_local_optimizer_state",
        "set_z3_leaf_modules",
    ],
    "deepspeed.zero": [
        "GatheredParameters",
        "Init",
        "OnDevice",
        "ZeroParamStatus",
        "ZeroParamType",
        "register_external_parameter",
        "unwrap_model_for_generation",
    ],
    "deepspeed.runtime.zero.partition_parameters": [
        "GatheredParameters",
        "Init",
        "OnDevice",
        "ZeroParamStatus",
        "ZeroParamType",
        "register_external_parameter",
        "unregister_external_parameter",
    ],
    "deepspeed.checkpoint.utils": [
        "clone_tensors_for_torch_save",
        "get_layer_ckpt_name_for_rank",
        "get_model_ckpt_name_for_rank",
        "get_zero_ckpt_name_for_rank",
    ],
    "deepspeed.accelerator": [
        "get_accelerator",
        "is_current_accelerator_supported",
        "set_accelerator",
    ],
    "deepspeed.comm": [
        "P2POp",
        "all_gather_coalesced",
        "all_reduce_coalesced",
        "all_to_all",
        "batch_isend_irecv",
        "get_all_ranks_from_group",
        "get_global_rank",
        "get_world_group",
        "has_all_gather_into_tensor",
        "has_reduce_scatter_tensor",
        "is_available",
        "ReduceOp",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "configure",
        "gather",
        "get_local_rank",
        "get_rank",
        "get_world_size",
        "inference_all_reduce",
        "init_distributed",
        "irecv",
        "is_initialized",
        "isend",
        "log_summary",
        "monitored_barrier",
        "new_group",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "send",
    ],
    "deepspeed.comm.comm": ["all_reduce", "get_global_rank", "init_distributed"],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_upstream_names_are_at_their_paths(module: str):
    m = importlib.import_module(module)
    missing = [n for n in SURFACE[module] if not hasattr(m, n)]
    assert missing == [], f"{module} lacks {missing}"


def test_torch_checkpoint_engine_writes_and_reads_files(tmp_path):
    """What a PipelineModule's layer-file hooks are handed: torch.save, the weights-only
    loader (an arbitrary object is refused with the file's name), upstream's queries."""
    import pathlib

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    files = TorchCheckpointEngine()
    where = tmp_path / "a" / "b"
    files.makedirs(str(where), exist_ok=True)
    w = torch.arange(4.0)
    files.save({"w": w}, str(where / "x.pt"))
    assert torch.equal(files.load(str(where / "x.pt"))["w"], w)
    assert files.load(str(where / "x.pt"), map_location="cpu")["w"].device.type == "cpu"
    assert files.preserves_storage_sharing() and not files.is_decoupled()
    assert files.is_data_parallel_writer(0) and not files.is_data_parallel_writer(1)
    assert files.commit(None) is True
    torch.save({"p": pathlib.PurePosixPath("x")}, where / "odd.pt")
    with pytest.raises(Exception, match="odd.pt"):
        files.load(str(where / "odd.pt"))
    with pytest.raises(TypeError):
        CheckpointEngine()  # abstract: save and load are a subclass's


def test_ops_and_utils_groups_after_a_plain_import():
    import deepspeed

    assert deepspeed.ops.adam.DeepSpeedCPUAdam is not None
    assert callable(deepspeed.utils.groups.get_data_parallel_world_size)


def test_deepspeed_config_object_has_upstreams_attributes(tmp_path):
    from deepspeed import DeepSpeedConfig

    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,'
        ' "bf16": {"enabled": true}, "zero_optimization": {"stage": 2},'
        ' "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}'
    )
    cfg = DeepSpeedConfig(str(path))  # no process group: a world of one
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 4)
    assert cfg.gradient_accumulation_steps == 2 and cfg.zero_optimization_stage == 2
    assert cfg.zero_enabled and cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 0.001}
    assert cfg.zero_config.stage == 2 and cfg._param_dict["bf16"] == {"enabled": True}

    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return 4

    sized = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 2}, Mpu())
    assert sized.train_micro_batch_size_per_gpu == 4


def test_zero_enums_and_config_models():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadParamConfig,
        OffloadDeviceEnum,
    )

    assert ZeroStageEnum.weights == 3 and ZeroStageEnum.gradients == 2
    assert DeepSpeedZeroConfig(stage=ZeroStageEnum.gradients).stage == 2
    assert DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu).device == "cpu"


def test_on_device_builds_on_meta_in_a_dtype():
    from deepspeed.zero import OnDevice

    before = torch.get_default_dtype()
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before
    with OnDevice(dtype=torch.float16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError, match="floating-point"):
        OnDevice(dtype=torch.int8)


def test_unwrap_for_generation_below_stage_3_is_the_module():
    from deepspeed.zero import unwrap_model_for_generation

    model = torch.nn.Linear(2, 2)
    with unwrap_model_for_generation(model) as m:
        assert m is model


def test_checkpoint_names_are_upstreams():
    from deepspeed.checkpoint.utils import (
        get_layer_ckpt_name_for_rank,
        get_model_ckpt_name_for_rank,
        get_zero_ckpt_name_for_rank,
    )

    assert get_model_ckpt_name_for_rank("d", "00") == "d/mp_rank_00_model_states.pt"
    assert get_zero_ckpt_name_for_rank("d", 3, 1) == "d/zero_pp_rank_3_mp_rank_01_optim_states.pt"
    assert get_layer_ckpt_name_for_rank("d", "layer_02", 0) == "d/layer_02-model_00_model_states.pt"


def test_torch_style_collectives_in_a_world_of_one():
    from deepspeed import comm as dist

    x = torch.arange(4.0)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, x)
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, x)
    assert torch.equal(gathered, x)
    objs: list = [None]
    dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]


def test_see_memory_usage_logs_only_when_forced(caplog: pytest.LogCaptureFixture):
    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed_ext.utils.logging import logger

    logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.INFO, logger="deepspeed_ext"):
            see_memory_usage("quiet")
            see_memory_usage("after init", force=True)
    finally:
        logger.propagate = False
    text = caplog.text
    assert "quiet" not in text and "after init | MA" in text and "CPU Virtual Memory" in text


def test_zero_init_refuses_upstream_arguments_it_does_not_run():
    from deepspeed import zero

    with pytest.raises(ValueError, match="zero_quantized_weights=...\\): quantized weights"):
        zero.Init(zero_quantized_weights=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'remote_devcie'"):
        zero.Init(remote_devcie="cpu")


def test_initialize_takes_upstreams_arguments_and_refuses_a_mesh():
    import inspect

    import deepspeed

    names = list(inspect.signature(deepspeed.initialize).parameters)
    assert names[:6] == [
        "args",
        "model",
        "optimizer",
        "model_parameters",
        "training_data",
        "lr_scheduler",
    ]
    assert {"distributed_port", "mesh_param", "config_params", "collate_fn"} <= set(names)
    with pytest.raises(ValueError, match="mesh_param=...\\): device meshes"):
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={}, mesh_param=(2, 2))


def test_the_ulysses_path_accelerate_opens_fails_saying_why():
    with pytest.raises(ImportError, match="Ulysses sequence parallelism .* not built"):
        importlib.import_module("deepspeed.runtime.sequence_parallel.ulysses_sp")

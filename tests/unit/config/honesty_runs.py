"""Training runs that touch what the runtime does with its config, recording which fields of
the typed config the runtime reads (importable by a spawned rank).

A read counts when code outside deepspeed_ext.config asks a config object for a field (or a
config method the runtime calls to ask it, RUNTIME_QUERIES): the config package's own checks
read everything and prove nothing about the runtime. Each scenario sets the keys it covers
to values other than their defaults where the runtime reads a key only when it is set."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.unit.runtime.models import batch, mlp

READS: set[tuple[str, str]] = set()
RUNTIME_QUERIES = {"resolve_batch", "layout_args"}


def install_recorder() -> None:
    from deepspeed_ext.config.model import DeepSpeedConfig
    from deepspeed_ext.config.types import Section

    def getattribute(self: Any, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name in type(self).model_fields:
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            if not caller.startswith("deepspeed_ext.config") or (
                frame.f_code.co_name in RUNTIME_QUERIES
            ):
                READS.add((type(self).__name__, name))
        return value

    for cls in (DeepSpeedConfig, Section):
        cls.__getattribute__ = getattribute  # type: ignore[method-assign]


def _steps(engine: Any, n: int = 2) -> None:
    dtype = next(engine.module.parameters()).dtype
    for micro in range(n * engine.gradient_accumulation_steps()):
        x, y = batch(micro, 0, size=4)
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()


def _save_load(engine: Any, d: str) -> None:
    engine.save_checkpoint(d, tag="t1")
    engine.load_checkpoint(d, tag="t1")
    engine.save_16bit_model(d, "model.bin")


def _base(d: str, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }


def _dense(d: str) -> dict[str, Any]:
    return _base(
        d,
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
        gradient_clipping=0.5,
        steps_per_print=1,
        wall_clock_breakdown=True,
        memory_breakdown=True,
        csv_monitor={"enabled": True, "output_path": d, "job_name": "c"},
        jsonl_monitor={"enabled": True, "output_path": d, "job_name": "j"},
        tensorboard={"enabled": True, "output_path": d, "job_name": "t"},
        wandb={"enabled": True, "project": "p", "group": "g"},  # offline: exercise()
        comet={
            "enabled": True,
            "online": False,
            "project": "p",
            "experiment_name": "n",
            "samples_log_interval": 1,
        },
        timers={"throughput": {"enabled": False}},
        log_level="info",
        dump_state=True,
        vocabulary_size=32,
        dataloader_drop_last=True,
        prescale_gradients=True,
        checkpoint={"tag_validation": "fail"},
        comms_logger={
            "enabled": True,
            "verbose": True,
            "prof_all": False,
            "prof_ops": ["broadcast"],
        },
        flops_profiler={
            "enabled": True,
            "profile_step": 1,
            "module_depth": 1,
            "top_modules": 2,
            "detailed": False,
            "output_file": f"{d}/flops.txt",
        },
        # checked at initialize even at one rank (sliced only with autotp_size > 1: tests/unit/tp)
        tensor_parallel={
            "preset_model": "llama",
            "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "row"}]},
        },
    )


def _zero2_fp16(d: str) -> dict[str, Any]:
    return _base(
        d,
        fp16={
            "enabled": True,
            "initial_scale_power": 8,
            "hysteresis": 1,
            "loss_scale_window": 10,
            "min_loss_scale": 0.5,
            "consecutive_hysteresis": True,
        },
        gradient_predivide_factor=2.0,
        fp16_override_modules=["GELU"],
        zero_force_ds_cpu_optimizer=False,
        zero_optimization={
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "overlap_comm": False,
            "reduce_scatter": False,
            "allgather_bucket_size": 1000,
        },
    )


def _zero1_bf16(d: str) -> dict[str, Any]:
    return _base(
        d,
        bf16={"enabled": True, "check_grad_overflow": False},
        data_types={"grad_accum_dtype": "fp32"},
        gradient_allreduce_op="sum",
        zero_allow_untested_optimizer=True,
        zero_optimization={"stage": 1, "reduce_bucket_size": 1000},
    )


def _zero3_nvme(d: str) -> dict[str, Any]:
    nvme = {"device": "nvme", "nvme_path": d}
    return _base(
        d,
        zero_optimization={
            "stage": 3,
            "offload_param": {**nvme, "buffer_count": 3, "buffer_size": 4096},
            "offload_optimizer": nvme,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            "leaf_module": {"names": ["0"], "name_suffixes": ["2"], "classes": ["GELU"]},
            "override_module_apply": False,
            "zero_allowed_param_types": ["Linear"],
            "zero_force_param_types": ["LayerNorm"],
        },
    )


def _compressed(d: str) -> dict[str, Any]:
    return _base(
        d,
        gradient_compression={"algorithm": "topk", "topk_ratio": 0.5, "huffman_coding": True},
        zero_optimization={"stage": 1},
    )


def _hierarchical(d: str) -> dict[str, Any]:
    return _base(
        d,
        communication={"topology": "hierarchical", "ranks_per_node": 1}
        | {"slow_node_tolerance": 0.5, "slow_node_interval": 1},
    )


# A client optimizer where the scenario's keys are about client optimizers.
CLIENT: dict[str, Callable[[Any], Any]] = {
    "zero2_fp16": lambda groups: torch.optim.AdamW(groups, lr=1e-3),
    "zero1_bf16": lambda groups: torch.optim.RMSprop(groups, lr=1e-3),
}

SCENARIOS: dict[str, Callable[[str], dict[str, Any]]] = {
    "dense": _dense,
    "zero2_fp16": _zero2_fp16,
    "zero1_bf16": _zero1_bf16,
    "zero3_nvme": _zero3_nvme,
    "compressed": _compressed,
    "hierarchical": _hierarchical,
}


def _pipeline(d: str) -> None:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule
    from tests.unit.runtime.pipe import pipe_runs as pr

    module = PipelineModule(
        pr.specs(),
        num_stages=1,
        loss_fn=pr.lm_loss,
        seed_layers=True,
        partition_method="uniform",
        activation_checkpoint_interval=1,
    )
    cfg = {
        "train_micro_batch_size_per_gpu": pr.MICRO,
        "gradient_accumulation_steps": 2,
        "pipeline": {
            "stages": 1,
            "partition": "uniform",
            "seed_layers": True,
            "activation_checkpoint_interval": 1,
            "use_reentrant": False,
            "schedule": "1f1b",
        },
    }
    engine, *_ = initialize(model=module, config=cfg, optimizer=lambda g: torch.optim.SGD(g, 0.1))
    engine.train_batch(iter(pr.batches(0, 0, 2)))
    engine.save_checkpoint(d, tag="p")
    engine.load_checkpoint(d, tag="p")
    engine.destroy()


def _sparse_attention() -> None:
    """Three layouts that between them use every key of the section, on models whose
    SparseSelfAttention modules the engine checks against it."""
    from deepspeed_ext.ops.sparse_attention import SparseSelfAttention, sparsity_config_from_dict
    from deepspeed_ext.runtime.initialize import initialize

    sections = [
        {"mode": "fixed", "block": 32, "different_layout_per_head": True, "num_local_blocks": 4}
        | {"num_global_blocks": 2, "attention": "unidirectional"}
        | {"horizontal_global_attention": False, "num_different_global_patterns": 2},
        {"mode": "variable", "num_random_blocks": 1, "local_window_blocks": [2]}
        | {"global_block_indices": [0], "global_block_end_indices": [1]},
        {"mode": "bigbird", "num_sliding_window_blocks": 1, "num_random_blocks": 1},
    ]
    for section in sections:
        model = nn.Sequential(nn.Linear(4, 4))
        layout = sparsity_config_from_dict(section, num_heads=2)
        model.add_module("attn", SparseSelfAttention(layout, max_seq_length=64))
        config = {"train_micro_batch_size_per_gpu": 2, "sparse_attention": section}
        engine, *_ = initialize(model=model, config=config, optimizer=lambda g: torch.optim.SGD(g))
        engine.destroy()


def exercise() -> list[tuple[str, str]]:
    """Every scenario: initialize, train, save and load; the fields the runtime read."""
    from deepspeed_ext.runtime.initialize import initialize

    install_recorder()
    data = torch.utils.data.TensorDataset(torch.randn(18, 16), torch.randn(18, 4))
    for name, make in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as d:
            # the W&B and Comet monitors write offline runs into the scenario's directory
            os.environ.update(
                WANDB_MODE="offline", WANDB_DIR=d, WANDB_SILENT="true", COMET_OFFLINE_DIRECTORY=d
            )
            config = make(d)
            if name == "zero3_nvme":
                from deepspeed_ext.zero.stage3 import Init

                with Init(config_dict_or_path=config):
                    model = mlp()
            else:
                model = mlp()
            engine, _, loader, _ = initialize(
                model=model,
                config=config,
                optimizer=CLIENT.get(name),
                training_data=data if name == "dense" else None,
            )
            if loader is not None:
                next(iter(loader))
            _steps(engine)
            _save_load(engine, os.path.join(d, "ckpt"))
            engine.destroy()
    with tempfile.TemporaryDirectory() as d:
        _pipeline(d)
    _sparse_attention()
    return sorted(READS)

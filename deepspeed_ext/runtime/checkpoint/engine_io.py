"""save_checkpoint / load_checkpoint for the engine (stage 0: rank 0 writes one file).

Layout (upstream's): <save_dir>/latest holds the tag; <save_dir>/<tag>/mp_rank_00_model_states.pt
holds the module, the optimizer (with fp32 masters for 16-bit models), the scheduler, the loss
scaler, counters, RNG states, the config, and the client_state keys at top level.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.version import __version__

from . import atomic, layout, safe_load, zero3_io
from .safe_load import CheckpointError

# Keys the engine owns; everything else in the file is the client's.
ENGINE_KEYS = frozenset(
    {
        "module",
        "optimizer",
        "master_weights",
        "lr_scheduler",
        "loss_scaler",
        "global_steps",
        "global_samples",
        "skipped_steps",
        "micro_steps",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "rng",
        "frozen_param_names",
        "buffer_names",
        "zero_stage",
        "zero_layouts",
        "zero3_params",
    }
)


def _module_state(engine: Any, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    sd = engine.module.state_dict()
    if exclude_frozen:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        out["accelerator"] = acc.get_rng_state()
    return out


def save_checkpoint(
    engine: Any,
    save_dir: str | Path,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else layout.default_tag(engine.global_steps)
    client_state = dict(client_state or {})
    clash = ENGINE_KEYS & client_state.keys()
    if clash:
        raise ValueError(
            f"client_state keys {sorted(clash)} are reserved by the engine; rename them"
        )
    stage = engine.zero_optimization_stage()
    # files are named by data-parallel rank and model-parallel rank (upstream's layout)
    dp_rank, mp_rank = engine.dp_rank, engine.layout.model.rank
    zero_file = layout.zero_optim_states_name(dp_rank, mp_rank)
    if comm.get_rank() == 0:
        safe_load.check_loadable(client_state, "client_state")
        atomic.prepare(save_dir, tag)
    comm.barrier()
    tmp = atomic.tmp_dir_for(save_dir, tag)
    if stage == 3:  # every rank writes its shards ([Note: stage-3 checkpoint])
        torch.save(zero3_io.rank_payload(engine), tmp / zero_file)
    elif stage:  # every rank writes its own partition
        torch.save(
            {
                "optimizer_state_dict": engine.optimizer.state_dict(),
                "fp32_partitions": engine.strategy.master_partitions(),
                "zero_stage": stage,
                "partition_count": engine.dp_world_size,
                "zero_layouts": engine.strategy.layouts(),
                "ds_version": __version__,
            },
            tmp / zero_file,
        )
    comm.barrier()
    if dp_rank == 0:  # one model-states file per model-parallel rank
        state = {
            "module": zero3_io.module_buffers(engine)
            if stage == 3
            else _module_state(engine, exclude_frozen_parameters),
            "zero3_params": zero3_io.param_table(engine) if stage == 3 else None,
            "optimizer": engine.optimizer.state_dict()
            if engine.optimizer is not None and not stage
            else None,
            "master_weights": _named(engine, engine.strategy.master_copies())
            if not stage
            else None,
            "buffer_names": [n for n, _ in engine.module.named_buffers()],
            "frozen_param_names": [
                n for n, p in engine.module.named_parameters() if not p.requires_grad
            ],
            "zero_stage": stage,
            "zero_layouts": engine.strategy.layouts() if stage in (1, 2) else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps,
            "dp_world_size": engine.dp_world_size,
            "mp_world_size": engine.mp_world_size,
            "ds_config": engine.config.to_dict(),
            "ds_version": __version__,
            "rng": _rng_state(),
            **client_state,
        }
        torch.save(state, tmp / layout.model_states_name(mp_rank))
    comm.barrier()
    if comm.get_rank() == 0:
        atomic.commit(save_dir, tag)
        if stage:
            _write_zero_to_fp32_script(save_dir)
        if save_latest:
            atomic.write_latest(save_dir, tag)
        logger.info(f"saved checkpoint {save_dir / tag}")
    comm.barrier()
    return True


def load_checkpoint(
    engine: Any,
    load_dir: str | Path,
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    load_dir = Path(load_dir)
    if tag is None:
        tag = atomic.read_latest(load_dir)
        if tag is None:
            logger.warning(
                f"no 'latest' file in {load_dir}: nothing loaded. Pass tag=... to load a "
                "specific checkpoint."
            )
            return None, None
    path = load_dir / str(tag) / layout.model_states_name(engine.layout.model.rank)
    state = safe_load.load(path)
    stage = engine.zero_optimization_stage()
    if stage == 3 or state.get("zero3_params"):
        _check_stage3(state, stage, path)
        with torch.no_grad():
            engine.module.load_state_dict(state["module"], strict=False)  # the buffers
        zero3_io.load(engine, path.parent, state, load_optimizer_states and not load_module_only)
    else:
        _load_module(engine.module, state, load_module_strict)
        engine.strategy.sync_masters_from_model()
    if not load_module_only:  # (stage 3's optimizer state came with its shards)
        if stage in (1, 2) and load_optimizer_states and engine.optimizer:
            _load_zero_partition(engine, path.parent, int(state.get("zero_stage") or 0))
        elif (
            stage == 0
            and load_optimizer_states
            and state.get("optimizer") is not None
            and engine.optimizer
        ):
            engine.optimizer.load_state_dict(state["optimizer"])
            if state.get("master_weights") is not None:
                saved = state["master_weights"]
                names = [n for n, _ in engine.module.named_parameters()]
                engine.strategy.load_master_copies([saved[n] for n in names])
        if load_lr_scheduler_states and engine.lr_scheduler and state.get("lr_scheduler"):
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if engine.loss_scaler is not None and state.get("loss_scaler"):
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        engine.global_steps = int(state["global_steps"])
        engine.global_samples = int(state["global_samples"])
        engine.skipped_steps = int(state["skipped_steps"])
        engine.micro_steps = int(state.get("micro_steps", 0))
        rng = state.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "python" in rng:
            random.setstate(_as_random_state(rng["python"]))
        if "accelerator" in rng and get_accelerator().device_name() != "cpu":
            get_accelerator().set_rng_state(rng["accelerator"])
    client_state = {k: v for k, v in state.items() if k not in ENGINE_KEYS}
    logger.info(f"loaded checkpoint {path.parent}")
    return str(path.parent), client_state


def _load_module(module: torch.nn.Module, state: dict[str, Any], strict: bool) -> None:
    """load_state_dict in place (ZeRO params are views into flat buffers). Strict still
    accepts the frozen parameters a save with exclude_frozen_parameters left out: the module
    keeps its own (pretrained) values for them, as a PEFT resume expects."""
    saved = state["module"]
    left_out = set(state.get("frozen_param_names") or []) - saved.keys()
    with torch.no_grad():
        result = module.load_state_dict(saved, strict=False)
    missing = [k for k in result.missing_keys if k not in left_out]
    if strict and (missing or result.unexpected_keys):
        raise CheckpointError(
            f"checkpoint does not match the model: missing keys {missing}, unexpected keys "
            f"{result.unexpected_keys}; pass load_module_strict=False to load what matches"
        )


def _check_stage3(state: dict[str, Any], stage: int, path: Path) -> None:
    if stage != 3 or not state.get("zero3_params"):
        raise CheckpointError(
            f"{path.parent} was written with zero_optimization.stage "
            f"{state.get('zero_stage')} and this engine runs stage {stage}: parameters "
            "partitioned by stage 3 load only into stage 3. Consolidate it with zero_to_fp32 "
            "and load the weights into the model instead"
        )


def _as_random_state(s: Any) -> tuple[Any, ...]:
    # weights_only loading keeps tuples, but be lenient with lists
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def _load_zero_partition(engine: Any, ckpt_dir: Path, saved_stage: int) -> None:
    if saved_stage == 0:
        raise CheckpointError(
            f"{ckpt_dir} was written without ZeRO (stage 0); load it with "
            "load_optimizer_states=False, or train with the stage it was saved with"
        )
    mp = engine.layout.model.rank
    first = safe_load.load(ckpt_dir / layout.zero_optim_states_name(0, mp))
    saved_world = int(first["partition_count"])
    if saved_world != engine.dp_world_size:
        _load_zero_resharded(engine, ckpt_dir, saved_world, first)
        return
    part = safe_load.load(ckpt_dir / layout.zero_optim_states_name(engine.dp_rank, mp))
    engine.strategy.check_layouts(part["zero_layouts"])
    engine.optimizer.load_state_dict(part["optimizer_state_dict"])
    engine.strategy.load_master_partitions(part["fp32_partitions"])


def _named(engine: Any, copies: list[torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Stage-0 fp32 masters keyed by parameter name (aligned with module.parameters())."""
    if copies is None:
        return None
    return dict(zip([n for n, _ in engine.module.named_parameters()], copies))


def _write_zero_to_fp32_script(save_dir: Path) -> None:
    """As upstream: a script beside the checkpoints that consolidates them with no setup."""
    script = save_dir / "zero_to_fp32.py"
    if not script.exists():
        script.write_text(
            "#!/usr/bin/env python\n"
            "# Consolidate the ZeRO checkpoints in this directory into fp32 weights:\n"
            "#   python zero_to_fp32.py . output_dir [--safe_serialization]\n"
            "import sys\n\n"
            "from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import main\n\n"
            "sys.exit(main())\n"
        )


def _load_zero_resharded(engine: Any, ckpt_dir: Path, saved_world: int, first: Any) -> None:
    """Partitions written by `saved_world` ranks, re-cut for this world (zero/reshard.py).
    Every rank reads every saved partition: memory is one full copy of a state at a time."""
    from deepspeed_ext.zero.layout import GroupLayout
    from deepspeed_ext.zero.reshard import chunks_for, full_by_name, split_partition

    mp = engine.layout.model.rank
    parts = [first] + [
        safe_load.load(ckpt_dir / layout.zero_optim_states_name(r, mp))
        for r in range(1, saved_world)
    ]
    old_layouts = [GroupLayout.from_dict(d) for d in first["zero_layouts"]]
    new_layouts = engine.strategy.group_layouts()
    engine.strategy.check_names(old_layouts)
    rank = engine.dp_rank
    masters = []
    for g, (old, new) in enumerate(zip(old_layouts, new_layouts)):
        per_rank = [split_partition(old, p["fp32_partitions"][g]) for p in parts]
        masters.append(torch.cat(chunks_for(new, rank, full_by_name(old, per_rank))))
    saved = [p["optimizer_state_dict"] for p in parts]
    current = engine.optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for g, (old, new) in enumerate(zip(old_layouts, new_layouts)):
        old_ids = [sd["param_groups"][g]["params"] for sd in saved]
        new_ids = current["param_groups"][g]["params"]
        template = saved[0]["state"].get(old_ids[0][0], {})
        for key, value in template.items():
            chunked = (
                torch.is_tensor(value)
                and key != "step"
                and value.dim() == 1
                and value.numel() == old.buckets[0].chunk(old.world_size)
            )
            if chunked:
                per_rank = [
                    [sd["state"][ids[b]][key] for b in range(len(old.buckets))]
                    for sd, ids in zip(saved, old_ids)
                ]
                new_chunks = chunks_for(new, rank, full_by_name(old, per_rank))
                for pid, chunk in zip(new_ids, new_chunks):
                    state.setdefault(pid, {})[key] = chunk
            else:  # per-step scalars (e.g. the step count) are the same for every chunk
                for pid in new_ids:
                    state.setdefault(pid, {})[key] = value
    groups = [
        {**{k: v for k, v in spg.items() if k != "params"}, "params": cpg["params"]}
        for spg, cpg in zip(saved[0]["param_groups"], current["param_groups"])
    ]
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})
    engine.strategy.load_master_partitions(masters)
    logger.info(
        f"resharded ZeRO checkpoint {ckpt_dir} from {saved_world} to {engine.dp_world_size} "
        "data-parallel ranks"
    )

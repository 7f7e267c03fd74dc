"""save_checkpoint / load_checkpoint for the engine (stage 0: rank 0 writes one file).

Layout (upstream's): <save_dir>/latest holds the tag; <save_dir>/<tag>/mp_rank_00_model_states.pt
holds the module, the optimizer (with fp32 masters for 16-bit models), the scheduler, the loss
scaler, counters, RNG states, the config, and the client_state keys at top level.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.version import __version__

from . import atomic, experts, layout, safe_load, tensor_slices
from .tag_check import validate_tag

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
        "pipeline",
        "tensor_parallel",
        "moe",
    }
)


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        out["accelerator"] = acc.get_rng_state()
    return out


def _warn_mid_accumulation(engine: Any) -> None:
    """A checkpoint holds no gradients: saved between a batch's micro-steps, its resume
    steps at that batch's boundary with the later micro-batches' gradients alone."""
    gas = int(engine.gradient_accumulation_steps())
    pending = int(getattr(engine, "_pending_backwards", 0))
    if pending and engine.rank == 0:
        logger.warning(
            f"save_checkpoint after {pending} backward(s) of a batch of {gas} micro-batches "
            "(gradient_accumulation_steps) whose optimizer step has not run: the gradients "
            "this batch has accumulated are not saved, so a resume steps at this batch's "
            "boundary with the later micro-batches' gradients only. Save after the "
            "engine.step() that completes a batch"
        )


def _drop_pending_gradients(engine: Any) -> None:
    """A load puts the engine at the saved batch boundary: gradients accumulated before it
    (an unfinished batch) would leak into its first step."""
    pending = int(getattr(engine, "_pending_backwards", 0))
    if pending:
        engine.zero_grad()
        if engine.rank == 0:
            logger.warning(
                f"load_checkpoint dropped the gradients of {pending} backward(s) since the last "
                "optimizer step: training continues from the checkpoint's batch boundary"
            )


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
    validate_tag(tag, str(engine.config.checkpoint.tag_validation))
    _warn_mid_accumulation(engine)
    stage = engine.zero_optimization_stage()
    # files are named by data-parallel rank and model-parallel rank (upstream's layout)
    dp_rank, mp_rank = engine.dp_rank, engine.layout.model.rank
    zero_file = layout.zero_optim_states_name(dp_rank, mp_rank)
    if comm.get_rank() == 0:
        safe_load.check_loadable(client_state, "client_state")
        atomic.prepare(save_dir, tag)
    comm.barrier()
    tmp = atomic.tmp_dir_for(save_dir, tag)
    strategy = engine.strategy
    # [Note: gradient strategy]: what each file holds is the strategy's
    per_rank = strategy.rank_state(engine.optimizer)
    if per_rank is not None:
        torch.save(per_rank, tmp / zero_file)
    engine._write_module_files(tmp, exclude_frozen_parameters)
    moe = experts.applies(engine)  # [Note: expert checkpoint files]
    if moe:
        experts.write_expert_files(engine, tmp, mp_rank)
    comm.barrier()
    if dp_rank == 0:  # one model-states file per model-parallel rank
        state = {
            **strategy.model_state(engine.optimizer, exclude_frozen_parameters),
            "buffer_names": [n for n, _ in engine.module.named_buffers()],
            "frozen_param_names": [
                n for n, p in engine.module.named_parameters() if not p.requires_grad
            ],
            "zero_stage": stage,
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
        # a pipeline wrote its layers to their own files (upstream's layout) and says so
        state.update(engine._checkpoint_extras(tmp, exclude_frozen_parameters))
        if getattr(engine, "autotp", None) is not None:  # [Note: tensor-slice table]
            state["tensor_parallel"] = tensor_slices.saved_info(engine)
        if moe:
            state = experts.model_state_part(engine, state)
        torch.save(state, tmp / layout.model_states_name(mp_rank))
    comm.barrier()
    if comm.get_rank() == 0:
        atomic.commit(save_dir, tag)
        if per_rank is not None and stage > 0:  # partitioned: consolidate with zero_to_fp32
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
    mp_rank = engine.layout.model.rank
    path = load_dir / str(tag) / layout.model_states_name(mp_rank)
    state = engine._checkpoint_state(load_dir / str(tag), path, load_module_strict)
    _drop_pending_gradients(engine)
    files = RankFileReader(path.parent, mp_rank)
    engine.strategy.load_model_state(state, load_module_strict, files)
    if not load_module_only:
        if load_optimizer_states and engine.optimizer is not None:
            engine._load_optimizer_state(state, files)
            zero = engine.config.zero_optimization
            if zero.stage and not zero.load_from_fp32_weights:  # the masters from the weights
                engine.strategy.sync_masters_from_model()
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


def _as_random_state(s: Any) -> tuple[Any, ...]:
    # weights_only loading keeps tuples, but be lenient with lists
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


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


class RankFileReader:
    """The zero_pp_rank files of a checkpoint directory for one model-parallel rank, each
    read once per load (by `load`: the safe loader, or zero_to_fp32's memory-mapped one)."""

    def __init__(
        self, where: Path, mp_rank: int, load: Callable[[Path], Any] = safe_load.load
    ) -> None:
        self.where = where
        self.mp_rank = mp_rank
        self._load = load
        self._read: dict[int, dict[str, Any]] = {}

    def has(self, dp_rank: int) -> bool:
        """Whether data-parallel rank dp_rank has a file (a run at a larger world size asks
        about ranks the saving run did not have)."""
        name = layout.zero_optim_states_name(dp_rank, self.mp_rank)
        return dp_rank in self._read or (self.where / name).exists()

    def read(self, dp_rank: int) -> dict[str, Any]:
        if dp_rank not in self._read:
            name = layout.zero_optim_states_name(dp_rank, self.mp_rank)
            self._read[dp_rank] = self._load(self.where / name)
        return self._read[dp_rank]

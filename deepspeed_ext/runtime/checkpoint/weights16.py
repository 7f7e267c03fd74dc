"""The full model weights in the training dtype, for the engine's save_16bit_model and the
_zero3_consolidated_16bit_state_dict that the HF Trainer and Accelerate save through.

[Note: consolidated weights]
Stages 0-2 keep every parameter whole on every rank, so the module's own state_dict is the full
model. A strategy that partitions parameters (stage 3) provides
`gathered_state_dict(exclude_frozen: bool) -> dict | None`: a collective every rank enters,
returning the full state dict on rank 0 and None elsewhere; when the engine's strategy has it,
it is used instead. Under tensor slicing the sliced weights are made whole first
([Note: tensor-slice table]); MoE experts spread over ranks are gathered and named globally
([Note: expert checkpoint files]). Either way rank 0 gets cloned tensors (a view into a flat ZeRO
buffer would otherwise drag the whole buffer into the file) and the other ranks None, as
upstream.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import comm, tp
from deepspeed_ext.utils.logging import logger

from . import experts
from .clone import clone_tensors_for_torch_save


def consolidated_state_dict(
    engine: Any, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """Every rank must call this (stage 3 gathers); rank 0 gets the state dict."""
    gather = getattr(engine.strategy, "gathered_state_dict", None)
    if gather is not None:
        return gather(exclude_frozen_parameters)
    # tensor slicing: the slices are gathered whole (as a plain model loads them) by the
    # tensor groups of data-parallel rank 0 (rank 0's among them); the others hold copies
    sliced = getattr(engine, "autotp", None) is not None and engine.layout.data.rank == 0
    sd = tp.full_state_dict(engine.module, engine.layout.tensor) if sliced else None
    if experts.spread(engine):  # MoE experts on other ranks: gathered, named globally
        sd = experts.whole_state_dict(engine, exclude_frozen_parameters)
    if comm.get_rank() != 0:
        return None
    sd = sd if sd is not None else engine.module.state_dict()
    if exclude_frozen_parameters:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return clone_tensors_for_torch_save(sd)


def gathers_on_save(engine: Any) -> bool:
    """Whether a stage-3 engine may gather full weights for saving (the config's
    stage3_gather_16bit_weights_on_model_save); stages 0-2 always hold them."""
    return engine.zero_optimization_stage() < 3 or engine.zero_gather_16bit_weights_on_model_save()


def save_16bit_model(
    engine: Any,
    save_dir: str | Path,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the full weights to save_dir/save_filename on rank 0 (.safetensors by that
    suffix), atomically: a crash leaves the previous file or none, never a partial one. At
    stage 3 without stage3_gather_16bit_weights_on_model_save it raises (upstream returns
    False and logs, and scripts that ignore the result ship no model)."""
    if not gathers_on_save(engine):
        raise ValueError(
            "save_16bit_model: ZeRO stage 3 partitions the weights and zero_optimization."
            "stage3_gather_16bit_weights_on_model_save is false, so nothing was saved: set it "
            "to true to gather the 16-bit weights on save, or save_checkpoint() and "
            "consolidate with zero_to_fp32"
        )
    state = consolidated_state_dict(engine, exclude_frozen_parameters)
    if comm.get_rank() == 0:
        assert state is not None
        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
            else:
                torch.save(state, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        logger.info(f"saved model weights to {path}")
    comm.barrier()
    return True

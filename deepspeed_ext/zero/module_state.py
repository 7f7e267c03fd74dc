"""The module's own weights in a checkpoint, for strategies that keep parameters whole
(stages 0-2): saved as the module's state dict, loaded in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.utils.errors import CheckpointError


def module_state(module: torch.nn.Module, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    sd = module.state_dict()
    if exclude_frozen:
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def load_module_state(
    module: torch.nn.Module, state: dict[str, Any], strict: bool, where: Path, stage: int
) -> None:
    """load_state_dict in place (ZeRO params are views into flat buffers). Strict still
    accepts the frozen parameters a save with exclude_frozen_parameters left out: the module
    keeps its own (pretrained) values for them, as a PEFT resume expects."""
    if state.get("zero3_params"):
        raise CheckpointError(
            f"{where} was written with zero_optimization.stage 3 and this engine runs stage "
            f"{stage}: parameters partitioned by stage 3 load only into stage 3. Consolidate "
            "it with zero_to_fp32 and load the weights into the model instead"
        )
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

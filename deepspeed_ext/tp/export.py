"""Whole weights from sliced ones: for 16-bit exports and checkpoints a plain model loads.

[Note: tensor-slice table]
A checkpoint written under tensor slicing records, per sliced parameter name, how it was cut
(`slice_table`: dim, sub-parameter sizes, the tensor-parallel size, the whole shape), so the
whole value can be made from the mp_rank files offline (zero_to_fp32) and re-cut for another
tensor-parallel size on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.comm import AxisGroup, all_gather

from .slicing import TensorSlice


def slice_table(module: torch.nn.Module) -> dict[str, list[Any]]:
    """[Note: tensor-slice table]: name -> [dim, parts, size, full shape]."""
    out: dict[str, list[Any]] = {}
    # every name of a tied parameter (a tied lm_head under its embedding's): the state dict
    # holds each, and a resume or export makes each whole by its own name
    for name, p in module.named_parameters(remove_duplicate=False):
        spec = getattr(p, "ds_tensor_slice", None)
        if spec is not None:
            out[name] = [spec.dim, list(spec.parts), spec.size, list(spec.full_shape)]
    return out


def spec_from_table(entry: list[Any], rank: int = 0) -> TensorSlice:
    dim, parts, size, shape = entry
    return TensorSlice(int(dim), tuple(int(p) for p in parts), int(size), rank, tuple(shape))


@torch.no_grad()
def full_state_dict(module: torch.nn.Module, axis: AxisGroup) -> dict[str, torch.Tensor]:
    """The module's state dict with every sliced parameter whole (an all-gather over the
    tensor group per sliced parameter: every rank of the group calls it)."""
    out: dict[str, torch.Tensor] = {}
    sliced = {
        name: p
        for name, p in module.named_parameters(remove_duplicate=False)  # tied names too
        if hasattr(p, "ds_tensor_slice")
    }
    whole: dict[int, torch.Tensor] = {}  # a tied parameter gathered once
    for name, value in module.state_dict().items():
        p = sliced.get(name)
        if p is None:
            out[name] = value
            continue
        if id(p) not in whole:
            local = p.detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(axis.size)]
            all_gather(parts, local, group=axis)
            whole[id(p)] = p.ds_tensor_slice.full(parts)
        out[name] = whole[id(p)]
    return out

"""MoE layers in the engine ([Note: expert groups]): each layer whose experts are spread over
ranks (ep_size > 1) gets its groups at initialize, and the parts of the engine that do not yet
run with such layers are refused by name before any training. Layers with ep_size 1 hold
every expert on every rank: plain replicated parameters, which everything runs with."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm.expert_groups import ensure_expert_groups
from deepspeed_ext.moe.layer import MOELayer
from deepspeed_ext.utils.logging import logger


def spread_layers(module: torch.nn.Module) -> list[MOELayer]:
    """The model's MoE layers with experts on several ranks."""
    return [m for m in module.modules() if isinstance(m, MOELayer) and m.ep_size > 1]


def configure(
    module: torch.nn.Module, config: Any, stage: int, pipeline: bool, tensor_size: int
) -> list[MOELayer]:
    """Make the expert groups of every spread layer (collective: every rank calls it)."""
    timed = bool(config.wall_clock_breakdown)  # upstream's MoE timing attributes
    for m in module.modules():
        if isinstance(m, MOELayer):
            m.wall_clock_breakdown = m.gate.wall_clock_breakdown = timed
    layers = spread_layers(module)
    before = bool(config.use_data_before_expert_parallelism)
    if not layers:
        if before:
            logger.warning(
                "use_data_before_expert_parallelism has no effect: the model has no MoE layer "
                "with ep_size > 1 (it orders the expert groups of such layers)"
            )
        return layers
    sizes = sorted({m.ep_size for m in layers})
    what = f"MoE layers with ep_size {', '.join(map(str, sizes))} (experts spread over ranks)"
    _refuse_unbuilt(config, stage, pipeline, tensor_size, what)
    for m in layers:
        m._set_ep_group(ensure_expert_groups(m.ep_size, before))
    _check_copies_alike(layers)
    return layers


def _check_copies_alike(layers: list[MOELayer]) -> None:
    """Each expert's copies (its expert-data group) must train the same params: a param
    frozen on one copy only gets a gradient bucket on the others, which then wait for it
    forever. Collective: every rank agrees before any refuses."""
    mismatched = []
    for li, m in enumerate(layers):
        assert m.ep_group is not None
        axis = m.ep_group.expert_data
        if axis.size == 1:
            continue
        dev = comm.collective_device(axis)
        mine = torch.tensor([float(p.requires_grad) for p in m.experts.parameters()], device=dev)
        low, high = mine.clone(), mine.clone()
        comm.all_reduce(low, op=comm.ReduceOp.MIN, group=axis)
        comm.all_reduce(high, op=comm.ReduceOp.MAX, group=axis)
        if not torch.equal(low, high):
            mismatched.append(li)
    if comm.sum_over(float(bool(mismatched))) > 0:  # on any rank
        where = (
            f"MoE layer(s) {mismatched} (in module order, of those with ep_size > 1) on this rank"
            if mismatched
            else "another rank's MoE layers"
        )
        raise ValueError(
            f"{where}: the copies of an expert (its expert-data-parallel group) freeze different "
            "parameters (requires_grad differs between ranks); freeze an expert alike on every "
            "rank that holds it, before deepspeed.initialize"
        )


def _refuse_unbuilt(config: Any, stage: int, pipeline: bool, tensor_size: int, what: str) -> None:
    def refuse(part: str, fix: str) -> ValueError:
        return ValueError(f"{what} with {part}: not built yet; {fix}")

    keep = "or build the layers with ep_size=1 (every expert on every rank)"
    if stage >= 3:  # as upstream: stages 1 and 2 partition each expert over its copies
        raise refuse(
            f"zero_optimization.stage {stage}",
            f"set zero_optimization.stage to 0, 1 or 2, {keep}",
        )
    if pipeline:
        raise refuse("pipeline parallelism", f"train without a PipelineModule, {keep}")
    if tensor_size > 1:
        raise refuse(f"tensor parallelism (size {tensor_size})", f"use tensor size 1, {keep}")
    if config.gradient_compression is not None:
        raise refuse("gradient_compression", f"remove the gradient_compression section, {keep}")
    # a 1-bit optimizer, from the config or given as an object, is refused once built
    # (refuse_local_grads)


def refuse_local_grads(layers: list[MOELayer], what: str) -> None:
    """Gradients left on each rank (1-bit optimizers, enable_backward_allreduce=False) with
    experts spread over ranks: their exchange spans the data-parallel group, and the norm
    would count no expert."""
    if layers:
        sizes = ", ".join(sorted({str(m.ep_size) for m in layers}))
        raise ValueError(
            f"{what} with MoE layers of ep_size {sizes} (experts spread over ranks): not built "
            "yet (it keeps each rank's gradients, exchanged over the whole data-parallel "
            "group); use Adam, or build the layers with ep_size=1"
        )

"""Tied weights across pipeline stages.

[Note: tied weights]
Layers given as TiedLayerSpecs with one key share their weights (`tied_weight_attr`) on
whichever stages they land: each such stage holds a copy. For every key held by more than
one stage there is one tie group per (data, tensor) coordinate: the ranks holding that key
in one pipeline replica. The copies start equal (a broadcast from the stage holding the key's
first layer), and stay equal because each step sums their gradients over the tie group before the
optimizer runs (the same update on the same weights). Only that stage's copy counts in
the gradient norm (the others carry `ds_pipe_replicated`, upstream's attribute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm import AxisGroup, PipelineParallelGrid

from .spec import TiedLayerSpec

if TYPE_CHECKING:
    from .module import PipelineModule


class TiedWeights:
    def __init__(self, module: PipelineModule, grid: PipelineParallelGrid) -> None:
        topo = grid.topology()
        stage = grid.get_stage_id()
        me = grid.get_global_rank()
        owners: dict[str, list[int]] = {}
        for idx, layer in enumerate(module._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                s = module.stage_owner(idx)
                if s not in owners.setdefault(layer.key, []):
                    owners[layer.key].append(s)
        self._entries: list[tuple[str, list[torch.nn.Parameter], AxisGroup]] = []
        self._source: dict[str, int] = {}  # key -> group rank of its first layer's stage
        for key in sorted(owners):  # every rank makes the same groups in the same order
            # the stage of the key's first layer first: its copy is the one a plain model
            # builds (under seed_layers, with that layer's seed), so the others take its
            # weights; in a V (DualPipeV) or interleaved layout it need not be the lowest stage
            stages = owners[key]
            mine: AxisGroup | None = None
            for r in range(topo.world_size()):
                coord = topo.get_coord(r)
                if coord.pipe != stages[0]:
                    continue
                by_stage = [topo.get_rank(**coord._replace(pipe=s)._asdict()) for s in stages]
                ranks = sorted(by_stage)  # group-rank order, as torch's group numbers them
                group = comm.new_group(ranks) if len(ranks) > 1 else None
                if me in ranks:
                    mine = AxisGroup(group, tuple(ranks), ranks.index(me))
                    self._source[key] = ranks.index(by_stage[0])
            if key not in module.tied_modules:
                continue
            assert mine is not None
            tied = module.tied_modules[key]
            params = [_attr(tied, a, key) for a in module.tied_weight_attrs[key]]
            for p in params:
                p.ds_pipe_replicated = stage != stages[0]
            self._entries.append((key, params, mine))
        self.synchronize()

    def synchronize(self) -> None:
        """Every stage's copy of a tied weight set to the first holding stage's (as built,
        and after weights were loaded by hand: upstream's _synchronize_tied_weights)."""
        with torch.no_grad():
            for key, params, group in self._entries:
                for p in params:
                    comm.group_broadcast(p.data, group, self._source[key])

    def entries(self) -> list[tuple[str, list[torch.nn.Parameter], AxisGroup]]:
        """(key, params, tie group) for each tied key this stage holds, in key order."""
        return list(self._entries)

    def shared(self) -> list[tuple[list[torch.nn.Parameter], AxisGroup]]:
        """The tied params whose tie group spans more than one stage."""
        return [(ps, g) for _, ps, g in self._entries if g.size > 1]

    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, ps, _ in self._entries for p in ps]

    def trained(self) -> list[tuple[list[torch.nn.Parameter], AxisGroup]]:
        """shared(), less frozen params (frozen on every stage alike: check_frozen_alike)."""
        out = [([p for p in ps if p.requires_grad], g) for ps, g in self.shared()]
        return [(ps, g) for ps, g in out if ps]

    def check_frozen_alike(self) -> None:
        """Every stage holding a tied weight freezes it or trains it alike (one collective
        per shared key, at engine start): frozen on one stage only, its copies would drift
        apart, and the stages would disagree about which gradients to sum."""
        for key, params, group in self._entries:
            if group.size < 2:
                continue
            dev = comm.collective_device(group)
            flags = torch.tensor([float(p.requires_grad) for p in params], device=dev)
            both = torch.cat([flags, -flags])
            comm.all_reduce(both, op=comm.ReduceOp.MAX, group=group)
            if torch.equal(both[: len(params)], -both[len(params) :]):
                continue
            raise ValueError(
                f"the weights tied under TiedLayerSpec key {key!r} are frozen "
                "(requires_grad=False) on some of the pipeline stages holding them and "
                "trained on others: freeze or unfreeze them on every stage alike (the tied "
                "module is PipelineModule.tied_modules[{key!r}] on each)"
            )

    def allreduce_param_grads(self) -> None:
        for params, group in self.shared():
            for p in params:
                if p.grad is not None:
                    comm.all_reduce(p.grad, group=group)


def _attr(module: torch.nn.Module, name: str, key: str) -> Any:
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"TiedLayerSpec(key={key!r}): {type(module).__name__} has no attribute "
                f"{name!r} (tied_weight_attr names the shared parameters)"
            )
        obj = getattr(obj, part)
    if not isinstance(obj, torch.nn.Parameter):
        raise ValueError(f"TiedLayerSpec(key={key!r}): {name!r} is not a parameter")
    return obj

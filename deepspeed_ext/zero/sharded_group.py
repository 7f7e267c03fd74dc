"""One optimizer param group, sharded: flat model params (full, as views), and this rank's
fp32 masters and reduced gradients, one per bucket chunk (see [Note: shard layout]), over the
group's own ranks: the data-parallel group, or for the params of MoE experts spread over
ranks their expert-data-parallel group ([Note: ZeRO with spread experts] in strategy.py).

Tensors (world W, rank r, group total T = sum of padded buckets, bucket b of B_b elements):
  flat        [T]       model dtype, on the model's device; every param is a view into it
  masters[b]  [B_b/W]   fp32 on the optimizer device (CPU with offload): the optimizer's params;
                        for an fp32 model on that device, views of the own chunks of `flat`
  grads[b]    [B_b/W]   accumulation dtype; the reducer decides where they live (stage 1: its
                        own chunk of the full bucket buffer, so no second copy exists)
"""

from __future__ import annotations

import torch

from deepspeed_ext.comm import AxisGroup
from deepspeed_ext.comm.expert_groups import ExpertGroups

from .layout import GroupLayout


class ShardedGroup:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        layout: GroupLayout,
        axis: AxisGroup,
        optimizer_device: torch.device,
        expert: ExpertGroups | None = None,
    ) -> None:
        params = [p for _, p in named_params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"a ZeRO param group must have one dtype, got {sorted(map(str, dtypes))}"
            )
        self.layout = layout
        self.axis = axis  # the ranks this group is partitioned over (layout.world_size of them)
        self.expert = expert  # the spread experts' groups; None: dense params
        self.rank = axis.rank
        self.world = layout.world_size
        by_name = {s.name: s for s in layout.slots}
        self.params = params
        self.slot_of = {id(p): by_name[n] for n, p in named_params}
        device = params[0].device
        self.flat = torch.zeros(layout.total, dtype=params[0].dtype, device=device)
        with torch.no_grad():
            for p in params:
                view = self.param_view(p)
                view.copy_(p.data)
                p.data = view  # the module now reads its weights from the flat buffer
        # An fp32 model's own chunk, already where the optimizer runs, is its own master: the
        # optimizer updates the model's flat buffer in place (no second copy, as stage 3).
        self.masters_are_views = params[0].dtype == torch.float32 and (
            torch.device(optimizer_device) == device
        )
        self.masters = [
            torch.nn.Parameter(
                self.own_chunk(b)
                if self.masters_are_views
                else torch.empty(
                    bk.chunk(self.world), dtype=torch.float32, device=optimizer_device
                ),
                requires_grad=False,
            )
            for b, bk in enumerate(layout.buckets)
        ]
        for m in self.masters:
            if hasattr(m, "grad_dtype"):  # torch >= 2.10: allow grads in the accumulation dtype
                m.grad_dtype = None
        self.grads: list[torch.Tensor] = []  # set by the reducer
        if not self.masters_are_views:
            with torch.no_grad():
                for b in range(len(layout.buckets)):
                    self.masters[b].copy_(self.own_chunk(b))

    # -- views ---------------------------------------------------------------------------------
    def bucket_view(self, b: int) -> torch.Tensor:
        bk = self.layout.buckets[b]
        return self.flat[bk.offset : bk.offset + bk.numel]

    def own_chunk(self, b: int) -> torch.Tensor:
        """This rank's chunk of bucket b in the flat model params."""
        c = self.layout.buckets[b].chunk(self.world)
        return self.bucket_view(b)[self.rank * c : (self.rank + 1) * c]

    def param_view(self, p: torch.Tensor) -> torch.Tensor:
        s = self.slot_of[id(p)]
        start = self.layout.buckets[s.bucket].offset + s.offset
        return self.flat[start : start + s.numel].view(s.shape)

    def master_partition(self) -> torch.Tensor:
        """This rank's masters of every bucket, concatenated (the checkpointed partition)."""
        return torch.cat([m.detach() for m in self.masters])

    @torch.no_grad()
    def load_master_partition(self, flat: torch.Tensor) -> None:
        off = 0
        for m in self.masters:
            m.copy_(flat[off : off + m.numel()])
            off += m.numel()

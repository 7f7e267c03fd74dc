"""One optimizer param group, sharded: flat model params (full, as views), and this rank's
fp32 master and gradient partitions (see [Note: shard layout]).

Tensors (world W, rank r, group total T = sum of padded buckets, partition P = T / W):
  flat    [T]  model dtype, on the model's device; every param is a view into it
  master  [P]  fp32 on the optimizer device (CPU with offload); the optimizer's one param
  grad    [P]  fp32 on the optimizer device; reduced gradients, summed over micro-steps
"""

from __future__ import annotations

import torch

from .layout import GroupLayout


class ShardedGroup:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        layout: GroupLayout,
        rank: int,
        optimizer_device: torch.device,
    ) -> None:
        params = [p for _, p in named_params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"a ZeRO param group must have one dtype, got {sorted(map(str, dtypes))}"
            )
        self.layout = layout
        self.rank = rank
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
        self.master = torch.nn.Parameter(
            torch.empty(layout.partition_numel, dtype=torch.float32, device=optimizer_device),
            requires_grad=False,
        )
        self.grad = torch.zeros(
            layout.partition_numel, dtype=torch.float32, device=optimizer_device
        )
        with torch.no_grad():
            for b in range(len(layout.buckets)):
                self.master_chunk(b).copy_(self.own_chunk(b))

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

    def _partition_slice(self, t: torch.Tensor, b: int) -> torch.Tensor:
        off = self.layout.partition_offset(b)
        return t[off : off + self.layout.buckets[b].chunk(self.world)]

    def master_chunk(self, b: int) -> torch.Tensor:
        return self._partition_slice(self.master.data, b)

    def grad_chunk(self, b: int) -> torch.Tensor:
        return self._partition_slice(self.grad, b)

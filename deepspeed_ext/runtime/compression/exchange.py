"""Gradients (or momenta) averaged over the data-parallel group by comm's compressed mean
with error feedback ([Note: compressed all-reduce]), the error buffers kept here.

Serves 1-bit Adam's momenta ([Note: 1-bit Adam]) and the `gradient_compression` section's
gradients: at stage 0 (`__call__`: every param's gradient through the same two collectives,
each with payloads of its own, at the end of an accumulation window instead of the fp32
all-reduce) and at ZeRO 1/2 (`reduce_scatter`: a bucket's chunks to their owners, instead of
the fp32 reduce-scatter). The error buffers are this rank's own and travel in its checkpoint
file (state_dict / load_state_dict)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.comm.compressed import ChunkCodec, CompressedAllReduce, RowCoder


class CompressedExchange:
    def __init__(self, codec: ChunkCodec, group: Any = None, rows: RowCoder | None = None) -> None:
        self.comm = CompressedAllReduce(codec, group, rows)
        self.worker: list[torch.Tensor] | None = None
        self.server: list[torch.Tensor] | None = None
        self.buckets: dict[int, torch.Tensor] = {}  # ZeRO: worker error per bucket

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor replaced by its (compressed, error-compensated) mean over the group."""
        sizes = [self.comm.padded(t.numel()) for t in tensors]
        dev = tensors[0].device
        if self.worker is None or [w.numel() for w in self.worker] != sizes:
            self.worker = [torch.zeros(n, device=dev) for n in sizes]
            self.server = [torch.zeros(n // self.comm.world, device=dev) for n in sizes]
        assert self.server is not None
        if self.worker[0].device != dev:  # loaded from a checkpoint onto the host
            self.worker = [w.to(dev) for w in self.worker]
            self.server = [w.to(dev) for w in self.server]
        self.comm.means_with_(tensors, self.worker, self.server)

    def reduce_scatter(self, key: int, bucket: torch.Tensor, out: torch.Tensor) -> None:
        """out := this rank's chunk of the group's mean of `bucket` (ZeRO 1/2)."""
        err = self.buckets.get(key)
        if err is None or err.numel() != bucket.numel():
            err = self.buckets[key] = torch.zeros(
                bucket.numel(), dtype=torch.float32, device=bucket.device
            )
        elif err.device != bucket.device:  # loaded from a checkpoint onto the host
            err = self.buckets[key] = err.to(bucket.device)
        self.comm.reduce_scatter_mean_(bucket, err, out)

    def state_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "server": self.server,
            "buckets": self.buckets,
            "world": self.comm.world,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """False (buffers restart at zero) when none were saved at this world size."""
        ok = state is not None and state.get("world") == self.comm.world
        self.worker = state["worker"] if ok and state else None
        self.server = state["server"] if ok and state else None
        self.buckets = dict(state.get("buckets") or {}) if ok and state else {}
        return ok

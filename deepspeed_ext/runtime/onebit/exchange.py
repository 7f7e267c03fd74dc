"""A list of tensors averaged over a group by the 1-bit all-reduce with error feedback
([Note: compressed all-reduce]), with the error buffers kept here, one pair per tensor.

Serves 1-bit Adam's momenta ([Note: 1-bit Adam]) and the `gradient_compression` section's
gradients at stage 0 (at the end of an accumulation window, instead of the fp32 all-reduce).
All tensors go through the same four collectives, each with scales of its own (one scale over
a whole bucket would drown a bias's values in a weight's). The error buffers are this rank's
own and travel in its checkpoint file (state_dict / load_state_dict)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.comm.compressed import CompressedAllReduce

from .codec import PackBitsCodec


class OneBitExchange:
    def __init__(self, group: Any = None) -> None:
        self.comm = CompressedAllReduce(PackBitsCodec(), group)
        self.worker: list[torch.Tensor] | None = None
        self.server: list[torch.Tensor] | None = None

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor replaced by its (1-bit estimated) mean over the group."""
        sizes = [self.comm.padded(t.numel()) for t in tensors]
        if self.worker is None or [w.numel() for w in self.worker] != sizes:
            dev = tensors[0].device
            self.worker = [torch.zeros(n, device=dev) for n in sizes]
            self.server = [torch.zeros(n // self.comm.world, device=dev) for n in sizes]
        assert self.server is not None
        self.comm.means_with_(tensors, self.worker, self.server)

    def state_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "server": self.server, "world": self.comm.world}

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """False (buffers restart at zero) when none were saved at this world size."""
        ok = state is not None and state.get("world") == self.comm.world
        self.worker = state["worker"] if ok and state else None
        self.server = state["server"] if ok and state else None
        return ok

"""The `gradient_compression` section's 1-bit gradient exchange at stage 0: at the end of an
accumulation window each rank's gradients are averaged over the data-parallel group by the
1-bit all-reduce with error feedback ([Note: compressed all-reduce]) instead of an fp32
all-reduce; all parameters go through the same four collectives, each with scales of its own
(one scale over a whole bucket would drown a bias's gradient in a weight's). The error buffers
are this rank's own and travel in its checkpoint file (state_dict / load_state_dict)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.comm.compressed import CompressedAllReduce

from .codec import PackBitsCodec


class CompressedGradients:
    def __init__(self, group: Any) -> None:
        self.comm = CompressedAllReduce(PackBitsCodec(), group)
        self.worker: list[torch.Tensor] | None = None
        self.server: list[torch.Tensor] | None = None

    def __call__(self, grads: list[torch.Tensor]) -> None:
        """Each gradient replaced by its (1-bit estimated) mean over the group."""
        sizes = [self.comm.padded(g.numel()) for g in grads]
        if self.worker is None or [w.numel() for w in self.worker] != sizes:
            dev = grads[0].device
            self.worker = [torch.zeros(n, device=dev) for n in sizes]
            self.server = [torch.zeros(n // self.comm.world, device=dev) for n in sizes]
        assert self.server is not None
        self.comm.means_with_(grads, self.worker, self.server)

    def state_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "server": self.server, "world": self.comm.world}

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """False (buffers restart at zero) when none were saved at this world size."""
        ok = state is not None and state.get("world") == self.comm.world
        self.worker = state["worker"] if ok and state else None
        self.server = state["server"] if ok and state else None
        return ok

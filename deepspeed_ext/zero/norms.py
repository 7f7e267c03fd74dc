"""Squared L2 norms of gradient buffers, on their devices, without full-size temporaries."""

from __future__ import annotations

import torch


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sum(x^2) as a 0-dim float64 tensor on `device`, with no host read: one foreach norm
    kernel per device the tensors live on (fp32 accumulate; 16-bit tensors are widened one
    at a time inside it, so no temporary the size of all gradients exists), the per-tensor
    norms squared and summed in float64 (so many tensors' squares do not overflow fp32
    together). inf/nan propagate."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ts in by_device.values():
        norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
        part = torch.stack(norms).double().square().sum()
        total += part.to(device)  # one scalar per device (offloaded grads: host to device)
    return total

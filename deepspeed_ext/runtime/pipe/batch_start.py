"""What a training batch stopped by its data agreement puts back (engine._run).

The first stage forwards its first micro-batch while the agreement is in flight; when some
stage's data failed, nothing has been sent, and the engine goes on as if the batch had never
started. That forward's side effects are undone: seed_layers' forward count, the sample
count, every random stream it drew from (CPU, device and the model-parallel tracker: dropout
without seed_layers), and the running statistics of norm layers that keep them (BatchNorm,
InstanceNorm with track_running_stats), the buffers a forward in train mode writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..activation_checkpointing import rng


def norm_layers(module: nn.Module) -> list[_NormBase]:
    """The layers whose forward in train mode updates buffers in place: running stats."""
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


def _running_stats(norms: list[_NormBase]) -> list[torch.Tensor]:
    # read at each mark: module.to() / half() replace buffer tensors, not the layers
    names = ("running_mean", "running_var", "num_batches_tracked")
    return [b for m in norms for b in (getattr(m, n, None) for n in names) if b is not None]


@dataclass
class BatchStart:
    micro_offset: int
    counted: Any
    streams: rng.RNGSnapshot
    stats: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer, its value at the start)


def mark(module: Any, metrics: Any, norms: list[_NormBase]) -> BatchStart:
    return BatchStart(
        module.micro_offset,
        metrics.mark(),
        rng.snapshot(),
        [(b, b.detach().clone()) for b in _running_stats(norms)],
    )


def rewind(start: BatchStart, module: Any, metrics: Any) -> None:
    module.micro_offset = start.micro_offset
    metrics.rewind(start.counted)
    rng.restore(start.streams)
    with torch.no_grad():
        for buf, was in start.stats:
            buf.copy_(was)

"""Re-partition ZeRO state saved by W ranks for W' ranks (resume at another world size).

Every per-rank tensor that ZeRO saves is a list of bucket chunks under a GroupLayout (see
[Note: shard layout]): rank r's chunk of bucket b. Joining the W chunks of each bucket gives
the full bucket, whose slots name every parameter; slicing the same named tensors into the
new layout gives each new rank its chunks. Memory: one full copy of the tensor being moved.
"""

from __future__ import annotations

import torch

from .layout import GroupLayout


def full_by_name(
    layout: GroupLayout, chunks_per_rank: list[list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """chunks_per_rank[r][b]: rank r's chunk of bucket b -> {param name: full flat tensor}."""
    out: dict[str, torch.Tensor] = {}
    for b in range(len(layout.buckets)):
        bucket = torch.cat([chunks[b].reshape(-1) for chunks in chunks_per_rank])
        for s in layout.slots:
            if s.bucket == b:
                out[s.name] = bucket[s.offset : s.offset + s.numel]
    return out


def chunks_for(
    layout: GroupLayout, rank: int, named: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """The new layout's bucket chunks for `rank`, cut from full named tensors (padding 0)."""
    out = []
    for b, bk in enumerate(layout.buckets):
        bucket = torch.zeros(bk.numel, dtype=next(iter(named.values())).dtype)
        for s in layout.slots:
            if s.bucket == b:
                bucket[s.offset : s.offset + s.numel] = named[s.name].reshape(-1)
        c = bk.chunk(layout.world_size)
        out.append(bucket[rank * c : (rank + 1) * c].clone())
    return out


def split_partition(layout: GroupLayout, flat: torch.Tensor) -> list[torch.Tensor]:
    """A saved flat partition (bucket chunks concatenated) -> its per-bucket chunks."""
    out, off = [], 0
    for bk in layout.buckets:
        c = bk.chunk(layout.world_size)
        out.append(flat[off : off + c])
        off += c
    return out

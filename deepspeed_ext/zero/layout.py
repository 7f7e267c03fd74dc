"""Where every trainable parameter lives in the flat buffers, and which rank owns what.

[Note: shard layout]
Per param group, parameters are taken in backward order (the reverse of module order, the
order autograd produces their gradients) and packed into buckets of about `bucket_numel`
elements. Each bucket is padded to a multiple of world_size and split into world_size equal
chunks; rank r owns chunk r of every bucket. So a bucket's reduce-scatter writes exactly the
owner's slice of the gradient partition, and its all-gather refills the whole bucket of model
parameters, which are views into it. A rank's partition is its chunks of all buckets, in
bucket order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Pad buckets so every chunk starts on a 64-byte boundary for fp32 (16 elements).
ALIGN = 16


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # within its bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    offset: int  # within the group's flat buffer
    numel: int  # padded: a multiple of world_size * ALIGN

    def chunk(self, world: int) -> int:
        return self.numel // world


@dataclass
class GroupLayout:
    world_size: int
    buckets: list[Bucket] = field(default_factory=list)
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def partition_numel(self) -> int:
        return self.total // self.world_size

    def partition_offset(self, bucket: int) -> int:
        """Where bucket `bucket`'s chunk starts inside a rank's partition."""
        return sum(b.chunk(self.world_size) for b in self.buckets[:bucket])

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "buckets": [asdict(b) for b in self.buckets],
            "slots": [{**asdict(s), "shape": list(s.shape)} for s in self.slots],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GroupLayout:
        return GroupLayout(
            world_size=int(d["world_size"]),
            buckets=[Bucket(**b) for b in d["buckets"]],
            slots=[ParamSlot(**{**s, "shape": tuple(s["shape"])}) for s in d["slots"]],
        )


def plan_group(
    named: list[tuple[str, tuple[int, ...], int]], world_size: int, bucket_numel: int
) -> GroupLayout:
    """named: (name, shape, numel) in module order; buckets are filled in reverse."""
    layout = GroupLayout(world_size)
    quantum = world_size * ALIGN
    cur: list[tuple[str, tuple[int, ...], int]] = []
    size = 0

    def close() -> None:
        nonlocal cur, size
        if not cur:
            return
        b = len(layout.buckets)
        padded = -(-size // quantum) * quantum
        offset = 0
        for name, shape, numel in cur:
            layout.slots.append(ParamSlot(name, shape, b, offset, numel))
            offset += numel
        layout.buckets.append(Bucket(layout.total, padded))
        cur, size = [], 0

    for item in reversed(named):
        cur.append(item)
        size += item[2]
        if size >= bucket_numel:
            close()
    close()
    return layout

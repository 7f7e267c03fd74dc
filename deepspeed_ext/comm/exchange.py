"""A reduce-scatter on a host (gloo) group as pairwise exchanges: each rank sends every peer
that peer's chunk of the bucket and adds what the peers send it into its own chunk.

[Note: reduce-scatter by exchange]
A reduce-scatter needs each rank to move (W-1)/W of the bucket once. The in-place all-reduce
that gloo otherwise offers ([Note: in-place collectives on gloo]) moves it twice and sums every
chunk on every rank; measured with torch 2.13 on 2 and 4 CPU ranks (1-26M-element fp32
buckets), the exchange took 0.26-0.55x its time.

What it receives has to land somewhere before it is added, and scratch is what ZeRO saves
memory from. A bucket whose peers' chunks hold at most _WHOLE_BYTES (4 MB: a 2-rank bucket of
up to 8 MB, the size a CPU run reduces while its backward goes on) is received whole, in the
background. A bigger one goes in column pieces of _PIECE_BYTES from each peer through two
scratch buffers, 2 x (W-1) pieces (2 MB on 2 ranks, never over _SCRATCH_MAX); the first two
pieces run in the background and each later one starts as wait() retires an earlier one
(gloo's point-to-point works make no progress report before wait()), so such a bucket
overlaps less of the backward than an all-reduce would; the biggest are the end-of-backward
flush, waited at once. A group's exchanges in flight hold at most _SCRATCH_MAX (16 MB): a new
one that would pass it first completes the group's oldest (stage 1 starts all its buckets'
reductions at once). The budget is per group, so whether a rank completes an exchange early
depends on that group's buckets alone, which all its ranks share. Measured on 2 ranks: a
peak-memory test's stage 1 (67 MB buckets) peaked as with the all-reduce with 1 MB pieces,
4-6 MB higher with 2 MB pieces, 10-20 MB with 8 MB pieces (0-25% faster than 1 MB); on the
48M GPT at stage 3 with 12.8 MB buckets (4.3 MB each in flight) the backward took 0.62-0.63 s
received whole, 0.68 s in 1 MB pieces, 0.69 s by all-reduce.

Across nodes the exchange is not always the better one: a node of L of the W ranks sends
L (W - L) chunks to the others, where the ring all-reduce carries 2 (W - 1) over a node's
boundary each way. pays() keeps the exchange while it sends no more (one node; 2 nodes x 2
ranks: 4 against 6 chunks; a hierarchical reduce-scatter's groups: one rank a node, or one
node) and the all-reduce otherwise. Nodes are every LOCAL_WORLD_SIZE consecutive ranks; at a
group's first bucket its ranks compare their LOCAL_WORLD_SIZE in one small all-reduce, so
all decide alike, and nodes of different sizes keep the all-reduce. bench/
hierarchical_allreduce.py (a 1 Gbit/s link between two network namespaces, a 25 MB bucket)
measured the flat reduce-scatter at 238 ms by exchange against 336 ms by all-reduce at 2 x 2,
and 480 ms against 400 ms at 2 x 4 (16 against 14 chunks). Only host tensors take either
path (gloo's point-to-point takes no CUDA memory).

Matching: gloo pairs a send with a receive by (peer, tag), in the order they were posted on
the pair's one connection. Every rank of the group posts its exchanges' pieces in the same
order (the same backward, the same waits), so one tag serves them all; it is apart from the
small tags of other point-to-point traffic between the same ranks.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from typing import Any

import torch

from .checked import dist, parts
from .layout import AxisGroup

_PIECE_BYTES = 1 << 20  # received from one peer in one piece of a bucket cut in pieces
_WHOLE_BYTES = 4 << 20  # a bucket whose peers' chunks hold at most this goes in one piece
_SCRATCH_MAX = 16 << 20  # the scratch of all exchanges in flight in this process
_TAG = 0x5EC7A6
# per group (its global ranks): exchanges started and not yet complete, oldest first
_live: dict[tuple[int, ...], deque[Exchange]] = {}
_pays: dict[tuple[int, ...], bool] = {}


def _columns(chunk: int, world: int, itemsize: int) -> int:
    """Columns of each rank's chunk that one piece moves."""
    if (world - 1) * chunk * itemsize <= _WHOLE_BYTES:
        return max(1, chunk)
    per_peer = min(_PIECE_BYTES, _SCRATCH_MAX // (2 * (world - 1)))
    return max(1, per_peer // itemsize)


def scratch_bytes(bucket_numel: int, world: int, itemsize: int) -> int:
    """The scratch one exchange of a bucket of `bucket_numel` elements over `world` ranks
    holds until it completes (the memory estimate counts it)."""
    c = bucket_numel // world
    if world < 2 or c == 0:
        return 0
    cols = _columns(c, world, itemsize)
    return min(2, -(-c // cols)) * (world - 1) * min(cols, c) * itemsize


def pays(axis: AxisGroup, pg: Any) -> bool:
    """Whether the exchange beats the all-reduce over the group (decided at its first
    bucket, alike on every rank): always inside one node; across nodes only while no node
    sends more bytes to the others than the all-reduce's ring carries over a node's boundary.
    Nodes are every LOCAL_WORLD_SIZE consecutive ranks, as the ranks agree on it; where they
    do not (nodes of different sizes), the all-reduce."""
    got = _pays.get(axis.ranks)
    if got is None:
        mine = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
        # one collective, the same on every rank of the group: the largest and smallest
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=torch.device("cpu"))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
        hi, lo = int(both[0]), -int(both[1])
        got = hi == lo and beats_ring(axis.ranks, hi)
        _pays[axis.ranks] = got
    return got


def beats_ring(ranks: tuple[int, ...], per_node: int) -> bool:
    """No node of `per_node` consecutive ranks (0: one node) holds L of the W ranks with
    L (W - L) chunks to send out above the ring all-reduce's 2 (W - 1) each way."""
    w = len(ranks)
    local = Counter(r // per_node for r in ranks).values() if per_node > 0 else [w]
    return max(n * (w - n) for n in local) <= 2 * (w - 1)


def forget() -> None:
    """Drop what this module keeps of process groups (their groups are being destroyed)."""
    _live.clear()
    _pays.clear()


def budget() -> int:
    """The most scratch the exchanges in flight hold together."""
    return _SCRATCH_MAX


def scratch_in_flight(ranks: tuple[int, ...]) -> int:
    """The scratch of the group's exchanges in flight."""
    return sum(x.scratch_bytes for x in _live.get(ranks, ()))


def make_room(axis: AxisGroup, bucket: torch.Tensor) -> None:
    """Over budget with the bucket's exchange: complete the group's oldest exchanges first.
    Every rank of the group decides alike (its same buckets in the same order), so the
    pieces match. Called before an exchange is timed (the comms logger), so that its time
    is its own."""
    live = _live.get(axis.ranks)
    need = scratch_bytes(bucket.numel(), axis.size, bucket.element_size())
    while live and scratch_in_flight(axis.ranks) + need > _SCRATCH_MAX:
        live[0].wait()


class Exchange:
    """out <- this rank's chunk of the sum over the group of every rank's bucket; the bucket
    is W equal chunks in group-rank order. Started at once; wait() completes it. The caller
    first calls make_room for the bucket (reduce_scatter_bucket does), which keeps the group
    within its scratch budget."""

    def __init__(self, out: torch.Tensor, bucket: torch.Tensor, axis: AxisGroup, pg: Any) -> None:
        w, size = axis.size, bucket.element_size()
        c = bucket.numel() // w
        self.out, self.pg = out, pg
        self.own = bucket[axis.rank * c : (axis.rank + 1) * c]
        # (global rank, that peer's chunk) for every other member
        self.peers = [
            (g, bucket[i * c : (i + 1) * c]) for i, g in enumerate(axis.ranks) if i != axis.rank
        ]
        cols = _columns(c, w, size)
        self.pieces = deque((a, min(a + cols, c)) for a in range(0, c, cols))
        self.scratch_bytes = scratch_bytes(bucket.numel(), w, size)
        self.live = _live.setdefault(axis.ranks, deque())
        n = min(cols, c)
        slots = min(2, len(self.pieces))
        self.scratch = [
            torch.empty((w - 1) * n, dtype=bucket.dtype, device=bucket.device) for _ in range(slots)
        ]
        self.pending: deque[tuple[list[Any], torch.Tensor, int, int]] = deque()
        for buf in self.scratch:
            self._start(buf)
        if self.scratch:
            self.live.append(self)

    def _start(self, buf: torch.Tensor) -> None:
        a, b = self.pieces.popleft()
        n, works = b - a, []
        for k, (peer, chunk) in enumerate(self.peers):
            works.append(parts.isend(chunk[a:b], peer, group=self.pg, tag=_TAG))
            works.append(parts.irecv(buf[k * n : (k + 1) * n], peer, group=self.pg, tag=_TAG))
        self.pending.append((works, buf, a, b))

    def wait(self, *args: Any) -> None:
        while self.pending:
            works, buf, a, b = self.pending.popleft()
            for work in works:
                work.wait(*args)
            n, own = b - a, self.own[a:b]
            for k in range(len(self.peers)):
                own.add_(buf[k * n : (k + 1) * n])
            if self.pieces:
                self._start(buf)
        if self.scratch:
            self.scratch = []
            self.live.remove(self)
            if self.own.data_ptr() != self.out.data_ptr():
                self.out.copy_(self.own)

"""Hierarchical all-reduce: the sum over a group whose ranks sit on several nodes, with each
byte crossing the node boundary once ([Note: hierarchical all-reduce]).

[Note: hierarchical all-reduce]
The group's ranks are cut into nodes of L consecutive global ranks (as the launcher places
them), and every node must hold the same number L of the group's ranks. For a buffer of S
elements cut into L pieces:
1. inside the node, reduce-scatter: local rank i gets the node's sum of piece i (an
   all-to-all of the pieces, summed by the receiver).
2. across the nodes, all-reduce of piece i among the ranks with local index i on every
   node: the L pieces cross the node boundary in parallel, S elements from each node in all.
3. inside the node, all-gather of the pieces: every rank has the sum.
A flat ring all-reduce over N nodes x L ranks moves 2 (NL - 1) / NL x S over each link that
crosses a node boundary; this moves 2 (N - 1) / N x S: for 2 nodes of 2 ranks, 1.5 S against
S. Steps 1 and 3 stay inside a node (shared memory, NVLink or loopback). NCCL's own
all-reduce already takes the topology into account; this is for gloo/TCP clusters, where
the flat ring does not.
Each reduction is a chain of three collectives, each on a process group of its own, cut
into segments: `advance` starts a segment's next collective when its previous one has
completed (as backward hands in more buckets; wait() at the end), in launch order on every
rank, so one segment crosses the nodes while the next is reduced inside them, and buckets
overlap backward as with the flat all-reduce.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .checked import REDUCE_SCATTER_OP, all_gather_into, dist, parts
from .comms_logging import comms_logger, logical_call
from .layout import AxisGroup
from .sharded import reduce_scatter_bucket


@dataclass(frozen=True)
class NodeGroups:
    local: AxisGroup  # this node's members of the group (the reduce-scatter's)
    cross: AxisGroup  # the group's members with this rank's local index, one per node
    gather: AxisGroup  # this node's members again (the all-gather's own group)
    pieces: int  # L: the group's ranks on each node

    @property
    def size(self) -> int:
        """The whole group's ranks: nodes x L."""
        return self.cross.size * self.pieces


def node_groups(axis: AxisGroup, ranks_per_node: int) -> tuple[NodeGroups | None, str]:
    """The sub-groups of `axis` by node (None, and why, when the flat all-reduce is what
    runs). Collective over the world: every rank calls it at the same point."""
    if axis.size == 1 or not dist.is_initialized():
        return None, "a group of one rank"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(axis.ranks))
    mine: NodeGroups | None = None
    why = ""
    for ranks in sorted({tuple(r) for r in everyone}):
        by_node: dict[int, list[int]] = {}
        for g in ranks:
            by_node.setdefault(g // ranks_per_node, []).append(g)
        counts = {len(v) for v in by_node.values()}
        if len(by_node) == 1 or len(counts) != 1:
            if ranks == axis.ranks:
                why = (
                    "every rank of the group is on one node"
                    if len(by_node) == 1
                    else f"its nodes hold different numbers of its ranks ({sorted(counts)})"
                )
            continue
        per = counts.pop()
        nodes = [sorted(v) for _, v in sorted(by_node.items())]
        # every rank creates every group, in the same order (new_group is collective)
        local = [(n, dist.new_group(n)) for n in nodes]
        cross = [(r, dist.new_group(r)) for r in ([n[i] for n in nodes] for i in range(per))]
        gather = [(n, dist.new_group(n)) for n in nodes]
        if ranks == axis.ranks:
            me = axis.ranks[axis.rank]
            mine = NodeGroups(_member(local, me), _member(cross, me), _member(gather, me), per)
    return mine, why


def _member(groups: list[tuple[list[int], Any]], me: int) -> AxisGroup:
    for ranks, group in groups:
        if me in ranks:
            return AxisGroup(group, tuple(ranks), ranks.index(me))
    raise AssertionError(f"rank {me} is in none of {[r for r, _ in groups]}")


class HierarchicalWork:
    """One buffer's hierarchical sum, in segments so that one segment crosses the nodes while
    the next is reduced inside them. Every rank must issue each group's collectives in the
    same order, whatever completes first where: each phase has a group of its own, and a
    segment enters a phase only after every segment before it (of this work and of those
    launched earlier: `advance`) has."""

    def __init__(self, buf: torch.Tensor, groups: NodeGroups, segments: int = 0) -> None:
        self.buf, self.groups = buf.view(-1), groups
        n, per = self.buf.numel(), groups.pieces
        # measured on a 1 Gbit/s link, 25 MB, 2 x 2 ranks: 2 segments 1.30x the flat speed,
        # 8 1.47x, 16 1.47-1.51x, 32 1.47x
        k = segments or _segments(n, n)
        # cuts on multiples of the piece count: every segment but the last is cut into equal
        # pieces in place (no padded copy)
        cuts = sorted({n * j // k // per * per for j in range(k)} | {n})
        self.segments = [_Segment(self.buf[a:b], groups) for a, b in zip(cuts, cuts[1:])]

    def wait(self) -> None:
        advance(self.segments, block=True)


def all_reduce_hierarchical(buf: torch.Tensor, groups: NodeGroups) -> Any:
    """The sum of `buf` over the node groups' ranks, in place, pending ([Note: hierarchical
    all-reduce]); the comms logger records it as one all_reduce of the buffer (its steps
    are not rows of their own), and its `segments` are advanced as backward goes on."""
    return logical_call(
        "all_reduce", buf.nbytes, groups.size, lambda: HierarchicalWork(buf, groups)
    )


def advance(segments: list[_Segment], block: bool = False) -> None:
    """Move segments (in launch order) to their next phases: without `block`, only where the
    current collective has completed and no earlier segment is behind."""
    for phase in (1, 2, 3):
        for seg in segments:
            if seg.phase >= phase:
                continue
            if seg.phase < phase - 1 or not (block or seg.work.is_completed()):
                break  # a later segment may not pass this one
            seg.step()


_SEGMENT = 1 << 18  # elements a segment at least: smaller buffers go whole


def _segments(numel: int, cuts: int) -> int:
    """How many segments a buffer of `numel` elements is cut into, at most `cuts` (the
    places it can be cut) and 16 (both sums' measured best on a 1 Gbit/s link)."""
    return max(1, min(16, cuts, numel // _SEGMENT))


class _Segment:
    """reduce-scatter inside the node (an all-to-all of pieces, summed here), all-reduce of
    this rank's piece across the nodes, all-gather inside the node. A segment that divides
    into the pieces is sent from and gathered into in place; only a ragged last one goes
    through a padded copy (copying the whole buffer up front delayed the first crossing by
    7.5 ms of 240 on 25 MB)."""

    def __init__(self, seg: torch.Tensor, groups: NodeGroups) -> None:
        self.seg, self.groups = seg, groups
        per = groups.pieces
        self.c = -(-seg.numel() // per)  # piece length, the last one padded
        self.padded = per * self.c != seg.numel()
        if self.padded:
            send = torch.zeros(per * self.c, dtype=seg.dtype, device=seg.device)
            send[: seg.numel()].copy_(seg)
        else:
            send = seg
        self.recv: Any = torch.empty_like(send)  # None once done
        self.mine: Any = None  # the node's sum of this rank's piece
        self.work: Any = parts.all_to_all_single(
            self.recv, send, group=groups.local.group, async_op=True
        )
        self.phase = 0  # 0-2: that step's collective in flight; 3: done

    def step(self) -> None:
        """Finish the current collective and start the next."""
        self.work.wait()
        g, c = self.groups, self.c
        if self.phase == 0:  # the node's sum of this rank's piece, in the first received
            self.mine = self.recv[:c]
            for i in range(1, g.pieces):
                self.mine.add_(self.recv[i * c : (i + 1) * c])
            self.work = parts.all_reduce(self.mine, group=g.cross.group, async_op=True)
        elif self.phase == 1:
            if self.padded:  # the gather writes over recv, where the sum is: move it out
                self.mine, into = self.mine.clone(), self.recv
            else:
                into = self.seg
            self.work = all_gather_into(
                into, self.mine, via=parts, group=g.gather.group, async_op=True
            )
        else:
            if self.padded:
                self.seg.copy_(self.recv[: self.seg.numel()])
            # done: a bucket's finished segments wait for the others (and the GradBuckets
            # for every bucket) before they are dropped, so their buffers go now
            self.work = self.recv = self.mine = None
        self.phase += 1


class _HierarchicalScatter:
    """[Note: hierarchical reduce-scatter]
    ZeRO's reduce-scatter of a bucket of W = N x L chunks (N nodes of L ranks; data rank
    r = n L + j owns chunk r) in two steps, so that each byte crosses the node boundary once:
    1. inside the node, reduce-scatter of the bucket reordered as [j][n] (local rank j gets
       the node's sum of chunks n L + j for every n);
    2. across the nodes, reduce-scatter of that piece among the ranks with local index j:
       node n's rank gets chunk n L + j summed over every rank.
    A node sends (N - 1) / N x S across, where the flat exchange sends L (N - 1) / N x S (and
    the ring all-reduce it falls back to 2 (W - 1) / W x S).
    The chunks' columns are cut into segments (as the all-reduce's buffer), each reordered
    into a copy of its own, so that one segment crosses the nodes while the next is reduced
    inside them. The first segment's step 1 starts at launch; the others run inside wait(),
    one ahead of the crossings: each segment's step 2 starts as its step 1 completes, in
    launch order on every rank (buckets are waited in launch order), and the crossing before
    it is then completed (an exchange in pieces moves only inside its wait()) and its copy
    dropped. On a CPU cluster, which is what this is for, the reordering and the steps inside
    the node then use time that wait() would spend idle on the link, not CPU taken from the
    backward, and a bucket in flight holds 1/16 of its reordered copy until it is waited.
    Measured on a 1 Gbit/s link, 25 MB, launched and waited at once: 159 ms with the two
    steps whole; in 16 segments 119-128 ms at 2 x 2 ranks (the crossing alone: 123 ms) and
    125-138 ms at 2 x 4; every segment's step 1 started at launch took 125-130 ms and
    159-162 ms (8 ranks on 2 cores: the reordering competes for them)."""

    def __init__(self, out: torch.Tensor, bucket: torch.Tensor, groups: NodeGroups) -> None:
        self.out, self.groups = out, groups
        c = bucket.numel() // groups.size
        self.chunks = bucket.view(groups.cross.size, groups.pieces, c)
        k = _segments(bucket.numel(), c)
        self.cuts = [c * s // k for s in range(k + 1)]
        self.steps = [self._inside(0)]

    def _inside(self, s: int) -> tuple[torch.Tensor, int, int, Any]:
        """Step 1 of segment s: its columns of every chunk, reordered as [j][n],
        reduce-scattered inside the node."""
        a, b = self.cuts[s], self.cuts[s + 1]
        g = self.groups
        order = self.chunks[:, :, a:b].transpose(0, 1).contiguous().view(-1)
        width = g.cross.size * (b - a)
        piece = order[g.local.rank * width : (g.local.rank + 1) * width]
        with comms_logger.muted():  # the parts of one row (reduce_scatter_bucket_hierarchical)
            work = reduce_scatter_bucket(piece, order, group=g.local)
        return piece, a, b, work

    def wait(self) -> None:
        if not self.steps:  # waited before (or failed partway: never issued twice)
            return
        step, self.steps = self.steps[0], []
        k = len(self.cuts) - 1
        crossing: deque[Any] = deque()
        for s in range(k):
            piece, a, b, work = step
            if s + 1 < k:  # the next segment's step 1, one ahead
                step = self._inside(s + 1)
            work.wait()
            with comms_logger.muted():
                crossing.append(reduce_scatter_bucket(self.out[a:b], piece, self.groups.cross))
            while len(crossing) > 1:
                crossing.popleft().wait()
        for work in crossing:
            work.wait()


def reduce_scatter_bucket_hierarchical(
    out: torch.Tensor, bucket: torch.Tensor, groups: NodeGroups
) -> Any:
    """reduce_scatter_bucket's result over node groups ([Note: hierarchical
    reduce-scatter]): out <- this rank's chunk of the sum. One reduce-scatter row of the
    bucket in the comms logger."""
    return logical_call(
        REDUCE_SCATTER_OP,
        bucket.nbytes,
        groups.size,
        lambda: _HierarchicalScatter(out, bucket, groups),
    )

"""Which gathers happen when: the recorded execution order, prefetching along it, keeping
parameters that come back soon, and checking that every rank gathers the same modules.

[Note: stage-3 prefetch]
One micro-step (a forward and its backward) gathers modules in an order that is the same
every micro-step for a static graph. The first micro-step records it (the trace); later ones
walk it with a cursor. After each fetch, the parameters of the next modules in the trace are
gathered asynchronously, up to stage3_prefetch_bucket_size elements ahead and never past
stage3_max_live_parameters gathered at once; shards offloaded to NVMe beyond that window
start reading into offload_param's buffer_count buffers. A module's parameters are kept
after its forward when the trace says they return within stage3_max_reuse_distance
elements of gathers. A fetch that departs from the trace stops prefetching for the rest of
the micro-step, and the new order becomes the trace. Every rank makes the same decisions
from the same trace, so the collectives stay paired.

[Note: stage-3 order check]
At the first gather of each forward and of each backward, every rank contributes (gather
number, module index, phase, a hash of the micro-step's gathers so far) to a tiny all-gather
on a process group of its own (so it does not wait behind the prefetches in flight). A rank
running a different sequence (an extra forward on one rank: its forward meets the others'
backward) is caught there and every rank raises an error naming each rank's module, rather
than pairing mismatched collectives or hanging; when only the hashes differ (a
data-dependent branch), the ranks swap their sequences to name the first gather that
differs. The wait is bounded (DS_ZERO3_ORDER_TIMEOUT, 60 s). DS_ZERO3_ORDER_CHECK=all checks
before every gather (catches a divergence at its first gather, for 20% of a CPU step here:
each check is a rendezvous), =0 turns it off.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from deepspeed_ext.comm import AxisGroup, all_gather_bucket, all_gather_object
from deepspeed_ext.comm.layout import side_group

from .gather import gather_params
from .param import ZeroParamStatus

FORWARD, BACKWARD = 0, 1


class RankDivergenceError(RuntimeError):
    pass


class GatherCoordinator:
    def __init__(
        self,
        names: list[str],
        params: list[list[Any]],
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        group: AxisGroup,
    ) -> None:
        self.dp = group  # the data-parallel ranks, which must gather in step
        self.names = names  # module index -> qualified name
        self.params = params  # module index -> the parameters it gathers
        self.numel = [sum(p.ds_numel for p in ps) for ps in params]
        self.prefetch_numel = prefetch_numel
        self.max_live = max_live_numel
        self.max_reuse = max_reuse_distance
        self.trace: list[int] | None = None
        self.recording: list[int] = []  # this micro-step's gathers: module index ...
        self.phases: list[int] = []  # ... and phase
        self.digest = 0  # a rolling hash of (module, phase) over the recording
        self.phase = -1
        self.cursor = 0
        self.ahead = 0  # trace[cursor:ahead] has been fetched ahead ...
        self.ahead_numel = 0  # ... and holds this many elements
        self.following = True  # this micro-step still matches the trace
        mode = os.environ.get("DS_ZERO3_ORDER_CHECK", "1").lower()
        self.check = mode not in ("0", "false", "off") and group.size > 1
        self.check_all = mode == "all"
        # Its own (CPU) group: on the main one the check would queue behind the bulk
        # prefetch gathers and reduce-scatters in flight, and wait for them every fetch.
        self.group = side_group(group) if self.check else None
        self.timeout = timedelta(seconds=float(os.environ.get("DS_ZERO3_ORDER_TIMEOUT", "60")))
        self.stats = {"fetches": 0, "prefetched": 0, "kept": 0}  # counts, for tests and logs

    # -- the micro-step --
    def _restart(self, following: bool) -> None:
        self.recording, self.phases = [], []
        self.digest, self.phase = 0, -1
        self.cursor = self.ahead = self.ahead_numel = 0
        self.following = following

    def begin_forward(self) -> None:
        """The root module's forward starts: a new micro-step (or an evaluation forward)."""
        self._restart(following=self.trace is not None)

    def end_backward(self) -> None:
        if self.recording and self.recording != self.trace:
            self.trace = self.recording  # first micro-step, or the graph changed
        self._restart(following=False)

    # -- fetching --
    def fetch(self, index: int, phase: int) -> None:
        if self.check and (self.check_all or phase != self.phase):
            self._check_order(index, phase)
        self.phase = phase
        self.digest = (self.digest * 1_000_003 + 2 * index + phase) % (1 << 61)
        self.recording.append(index)
        self.phases.append(phase)
        self.stats["fetches"] += 1
        if self.following:
            assert self.trace is not None
            if self.cursor < len(self.trace) and self.trace[self.cursor] == index:
                if self.cursor < self.ahead:  # it leaves the prefetched window
                    self.ahead_numel -= self.numel[index]
                self.cursor += 1
            else:
                self.following = False
        gather_params(self.params[index])
        if self.following:
            self._prefetch()

    def _live_numel(self) -> int:
        return sum(
            p.ds_numel
            for ps in self.params
            for p in ps
            if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE
        )

    def _prefetch(self) -> None:
        """Extend the window trace[cursor:ahead] (modules already fetched ahead) while it
        holds fewer than prefetch_numel elements; one gather for what it adds (one
        collective per dtype)."""
        assert self.trace is not None
        i = max(self.cursor, self.ahead)
        live: int | None = None
        seen: set[int] = set()
        batch: list[Any] = []
        while i < len(self.trace) and self.ahead_numel < self.prefetch_numel:
            index = self.trace[i]
            need = [
                p
                for p in self.params[index]
                if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and id(p) not in seen
            ]
            if need:
                n = sum(p.ds_numel for p in need)
                live = self._live_numel() if live is None else live
                if live + n > self.max_live:
                    break
                seen.update(id(p) for p in need)
                batch.extend(need)
                self.stats["prefetched"] += 1
                live += n
            self.ahead_numel += self.numel[index]
            i += 1
        self.ahead = i
        if batch:
            gather_params(batch, wait=False)
        self._read_ahead(i)

    def _read_ahead(self, start: int) -> None:
        """NVMe-offloaded shards of the modules after the gather window start reading now,
        into offload_param's buffers, so that their gathers find them in memory."""
        assert self.trace is not None
        for index in self.trace[start:]:
            for p in self.params[index]:
                swap = p.ds_swap
                if swap is None or p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                    continue
                if not swap.read_ahead(p):
                    return  # no buffer free

    def keep_after_forward(self, index: int) -> bool:
        """Whether the trace brings this module back within the reuse distance."""
        if not self.following or self.trace is None:
            return False
        distance = 0
        for i in self.trace[self.cursor :]:
            if i == index:
                keep = distance < self.max_reuse and self._live_numel() <= self.max_live
                self.stats["kept"] += int(keep)
                return keep
            distance += self.numel[i]
            if distance >= self.max_reuse:
                return False
        return False

    # -- [Note: stage-3 order check] --
    def _check_order(self, index: int, phase: int) -> None:
        world = self.dp.size
        mine = torch.tensor([len(self.recording), index, phase, self.digest], dtype=torch.int64)
        everyone = torch.empty(4 * world, dtype=torch.int64)
        work = all_gather_bucket(everyone, mine, group=self.group)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankDivergenceError(
                f"ZeRO-3: rank {self.dp.global_rank(self.dp.rank)} waited "
                f"{self.timeout.total_seconds():.0f} s for "
                f"the other ranks at gather #{len(self.recording)} (module "
                f"'{self.names[index]}'): some rank is running a different sequence of "
                f"forwards/backwards or is stuck ({str(exc).splitlines()[0]})"
            ) from None
        rows = everyone.view(world, 4).tolist()
        if all(r == rows[0] for r in rows):
            return
        if all(r[:3] == rows[0][:3] for r in rows):  # same place, different ways there
            rows = self._first_difference()
        where = "; ".join(
            f"rank {self.dp.global_rank(r)}: gather #{n} of module '{self._name(i)}' in "
            f"{'backward' if ph else 'forward'}"
            for r, (n, i, ph, *_) in enumerate(rows)
        )
        raise RankDivergenceError(
            f"ZeRO-3 ranks diverged: {where}. Every rank must run the same sequence of "
            "forward and backward passes (e.g. run evaluation on every rank, not on rank "
            "0 only); mark modules with data-dependent children as leaves with "
            "deepspeed.utils.set_z3_leaf_modules"
        )

    def _first_difference(self) -> list[list[int]]:
        """Every rank's (gather number, module, phase) at the first gather where the ranks'
        sequences differ (index -1: that rank had no such gather)."""
        mine = list(zip(self.recording, self.phases))
        seqs = all_gather_object(mine, group=self.group)
        n = 0
        while all(n < len(s) for s in seqs) and all(s[n] == seqs[0][n] for s in seqs):
            n += 1
        return [[n, *(s[n] if n < len(s) else (-1, 0))] for s in seqs]

    def _name(self, index: int) -> str:
        return self.names[index] if 0 <= index < len(self.names) else f"#{index}"

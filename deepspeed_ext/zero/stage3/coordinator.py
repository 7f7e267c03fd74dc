"""Which gathers happen when: the recorded execution order, prefetching along it, keeping
parameters that come back soon, and checking that every rank gathers the same modules.

[Note: stage-3 prefetch]
One micro-step (a forward and its backward) gathers modules in an order that is the same
every micro-step for a static graph. The first micro-step records it (the trace); later ones
walk it with a cursor. After each fetch, the parameters of the next modules in the trace are
gathered asynchronously, up to stage3_prefetch_bucket_size elements ahead and never past
stage3_max_live_parameters gathered at once. A module's parameters are kept after its forward
when the trace says they return within stage3_max_reuse_distance elements of gathers. A fetch
that departs from the trace stops prefetching for the rest of the micro-step, and the new
order becomes the trace. Every rank makes the same decisions from the same trace, so the
collectives stay paired.

[Note: stage-3 order check]
Before each module's gather, every rank contributes (gather number, module index, phase) to a
tiny all-gather; a rank that runs a different sequence (an extra forward on one rank, a
data-dependent branch) is caught at its first differing gather, and every rank raises an
error naming each rank's module, rather than pairing mismatched collectives or hanging. The
wait is bounded (DS_ZERO3_ORDER_TIMEOUT, 60 s). DS_ZERO3_ORDER_CHECK=0 turns it off (it costs
one small collective per module gather).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from deepspeed_ext.comm import all_gather_bucket, get_rank, get_world_size

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
    ) -> None:
        self.names = names  # module index -> qualified name
        self.params = params  # module index -> the parameters it gathers
        self.numel = [sum(p.ds_numel for p in ps) for ps in params]
        self.prefetch_numel = prefetch_numel
        self.max_live = max_live_numel
        self.max_reuse = max_reuse_distance
        self.trace: list[int] | None = None
        self.recording: list[int] = []
        self.cursor = 0
        self.following = True  # this micro-step still matches the trace
        self.check = os.environ.get("DS_ZERO3_ORDER_CHECK", "1") != "0" and get_world_size() > 1
        self.timeout = timedelta(seconds=float(os.environ.get("DS_ZERO3_ORDER_TIMEOUT", "60")))
        self.stats = {"fetches": 0, "prefetched": 0, "kept": 0}  # counts, for tests and logs

    # -- the micro-step --
    def begin_forward(self) -> None:
        """The root module's forward starts: a new micro-step (or an evaluation forward)."""
        self.recording = []
        self.cursor = 0
        self.following = self.trace is not None

    def end_backward(self) -> None:
        if self.recording and self.recording != self.trace:
            self.trace = self.recording  # first micro-step, or the graph changed
        self.recording = []
        self.cursor = 0
        self.following = False

    # -- fetching --
    def fetch(self, index: int, phase: int) -> None:
        if self.check:
            self._check_order(index, phase)
        self.recording.append(index)
        self.stats["fetches"] += 1
        if self.following:
            assert self.trace is not None
            if self.cursor < len(self.trace) and self.trace[self.cursor] == index:
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
        assert self.trace is not None
        budget = self.prefetch_numel
        live = self._live_numel()
        seen: set[int] = set()
        for index in self.trace[self.cursor :]:
            if budget <= 0:
                break
            need = [
                p
                for p in self.params[index]
                if p.ds_status is ZeroParamStatus.NOT_AVAILABLE and id(p) not in seen
            ]
            n = sum(p.ds_numel for p in need)
            if live + n > self.max_live:
                break
            if need:
                seen.update(id(p) for p in need)
                gather_params(need, wait=False)
                self.stats["prefetched"] += 1
                budget -= n
                live += n

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
        world = get_world_size()
        mine = torch.tensor([len(self.recording), index, phase], dtype=torch.int64)
        everyone = torch.empty(3 * world, dtype=torch.int64)
        work = all_gather_bucket(everyone, mine)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise RankDivergenceError(
                f"ZeRO-3: rank {get_rank()} waited {self.timeout.total_seconds():.0f} s for "
                f"the other ranks at gather #{len(self.recording)} (module "
                f"'{self.names[index]}'): some rank is running a different sequence of "
                f"forwards/backwards or is stuck ({str(exc).splitlines()[0]})"
            ) from None
        rows = everyone.view(world, 3).tolist()
        if any(r != rows[0] for r in rows):
            where = "; ".join(
                f"rank {r}: gather #{n} of module '{self._name(i)}' in "
                f"{'backward' if ph else 'forward'}"
                for r, (n, i, ph) in enumerate(rows)
            )
            raise RankDivergenceError(
                f"ZeRO-3 ranks diverged: {where}. Every rank must run the same sequence of "
                "forward and backward passes (e.g. run evaluation on every rank, not on rank "
                "0 only); mark modules with data-dependent children as leaves with "
                "deepspeed.utils.set_z3_leaf_modules"
            )

    def _name(self, index: int) -> str:
        return self.names[index] if 0 <= index < len(self.names) else f"#{index}"

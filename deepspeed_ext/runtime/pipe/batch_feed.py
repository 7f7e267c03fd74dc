"""Where a pipeline's first and last stages get their micro-batches: the data iterator,
upstream's batch_fn, and eval_batch's micro-batches pulled before the schedule starts. The
stages between read nothing."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepspeed_ext import comm

from .errors import PipelineError


class BatchFeed:
    def __init__(self, stage_id: int, rank: int, needs_data: bool) -> None:
        self.stage_id, self.rank, self.needs_data = stage_id, rank, needs_data
        self.iterator: Iterator[Any] | None = None
        # upstream's post-processing of each batch (set_batch_fn, or assigned): it gets None
        # on a data stage without an iterator (a tensor rank whose batch it broadcasts)
        self.batch_fn: Callable[[Any], Any] | None = None
        self._prefetched: deque[Any] = deque()  # an eval batch's micro-batches, pulled first
        self._checked = False

    def next(self) -> Any:
        if self._prefetched:
            return self._prefetched.popleft()
        return self._pull()

    def _pull(self) -> Any:
        if self.iterator is None and self.batch_fn is None:
            raise PipelineError(
                f"stage {self.stage_id} (rank {self.rank}) has no data iterator: pass "
                "train_batch(data_iter=...) / eval_batch(data_iter) on every rank of the first "
                "and last stages (or set_batch_fn(fn), which then gets None there)"
            )
        batch = next(self.iterator) if self.iterator is not None else None
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(
                f"stage {self.stage_id}: the data iterator gave a {type(batch).__name__}; a "
                "pipeline batch is a pair (inputs, labels): the first stage reads inputs, the "
                "last stage labels"
            )
        return batch

    def prefetch(self, m: int, device: torch.device) -> None:
        """eval_batch's m micro-batches, pulled before any stage sends, and whether every
        data stage had them, agreed over all ranks: evaluation data running out (an eval
        loop's usual end) raises StopIteration on every rank before the pipeline starts,
        so the engine stays usable, where running out mid-batch would leave that batch's
        messages queued between stages (the engine would then refuse further batches).
        A batch_fn that broadcasts over the tensor group (Megatron's) must itself cope with
        its reading rank running out: the other ranks wait in its broadcast (as upstream)."""
        ran_out: StopIteration | None = None
        if self.needs_data:
            try:
                for _ in range(m):
                    self._prefetched.append(self._pull())
            except StopIteration as e:
                ran_out = e
        flag = torch.tensor([1.0 if ran_out is not None else 0.0], device=device)
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        if ran_out is not None:
            raise ran_out
        if flag.item():
            raise StopIteration("eval_batch: the evaluation data ran out on another rank's stage")

    def drop_prefetched(self) -> None:
        self._prefetched.clear()

    def check(self, world_size: int, device: torch.device) -> None:
        """On the first batch, every rank learns which stages lack an iterator they need,
        before any p2p; later a stage that finds none raises and aborts its neighbours
        ([Note: pipeline p2p]), which saves a collective per batch."""
        if self._checked:
            return
        self._checked = True
        missing = torch.zeros(world_size, dtype=torch.float64, device=device)
        if self.needs_data and self.iterator is None and self.batch_fn is None:
            missing[self.rank] = 1.0
        comm.all_reduce(missing)
        if missing.any():
            ranks = [int(r) for r in missing.nonzero().flatten()]
            raise PipelineError(
                f"rank(s) {ranks} (first or last pipeline stage) have no data iterator: pass "
                "train_batch(data_iter=...) / eval_batch(data_iter) on every rank of the first "
                "and last stages, or training_data= to deepspeed.initialize (or a batch_fn, "
                "set_batch_fn, which then gets None there to fill, as upstream's does)"
            )

"""Where a pipeline's first and last stages get their micro-batches: the data iterator,
upstream's batch_fn, and a batch's micro-batches pulled before the schedule starts. The
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
        self._prefetched: deque[Any] = deque()  # a batch's micro-batches, pulled first
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

    def prefetch(self, m: int, device: torch.device, caller: str) -> Agreement:
        """A batch's m micro-batches, pulled before any stage sends, and whether every data
        stage had them, agreed over all ranks (Agreement.wait): data running out (an
        epoch's or an eval loop's usual end) raises StopIteration on every rank before the
        pipeline starts, so the engine stays usable, where running out mid-batch would leave
        that batch's messages queued between stages (the engine would then refuse further
        batches). A batch_fn that broadcasts over the tensor group (Megatron's) must itself
        cope with its reading rank running out: the others wait in its broadcast (as
        upstream)."""
        failed: Exception | None = None
        if self.needs_data:
            try:
                for _ in range(m):
                    self._prefetched.append(self._pull())
            except Exception as e:  # noqa: BLE001 - agreed on, then raised by wait()
                failed = e
        return Agreement(self, failed, device, caller)

    def drop_prefetched(self) -> None:
        self._prefetched.clear()

    def check(self, world_size: int, device: torch.device) -> None:
        """On the first batch, every rank learns which stages lack an iterator they need,
        before any p2p, with the ranks named; later a stage that finds none fails in
        prefetch, which every rank agrees on."""
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


class Agreement:
    """Whether every data stage read its micro-batches (the worst code, a max over all
    ranks), agreed in the background: train_batch runs the first stage's first forward
    meanwhile (the ranks still stepping from the last batch would hold it up) and waits
    before anything else."""

    def __init__(self, feed: BatchFeed, failed: Exception | None, device: Any, caller: str):
        self.feed, self.failed, self.caller = feed, failed, caller
        # 1: ran out, 2: failed otherwise; any other rank's failure stops this one too
        code = 0.0 if failed is None else 1.0 if isinstance(failed, StopIteration) else 2.0
        self.flag = torch.tensor([code], device=device)
        self.work = comm.all_reduce(self.flag, op=comm.ReduceOp.MAX, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        code = self.flag.item()
        if code:
            self.feed.drop_prefetched()
        if self.failed is not None:
            raise self.failed
        if code == 1.0:
            raise StopIteration(f"{self.caller}: the data ran out on another rank's stage")
        if code:
            raise PipelineError(
                f"{self.caller}: another rank's stage failed to read its micro-batches (its "
                "own error says why); nothing was sent, so the engine can go on"
            )

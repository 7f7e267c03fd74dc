"""The dataloader deepspeed.initialize returns when given training_data: a DistributedSampler
(each rank its own shard, reshuffled per epoch) and the micro-batch size from the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DeepSpeedDataLoader:
    """Upstream's constructor, attributes (dataset, batch_size, collate_fn, data_sampler and
    .sampler, num_local_io_workers, pin_memory, dataloader_drop_last, len) and iteration
    (iter() starts a pass; next() on the loader itself goes on with the current one).
    Beyond upstream: `shuffle` and `seed` for the sampler it makes; `tput_timer` is accepted
    and unused (the engine's metrics time the steps); no worker processes unless
    num_local_io_workers asks (upstream starts two).

    [Note: epochs of the loader]
    Each pass that runs to its end moves the sampler to the next epoch (a new shuffle, the
    same on every rank), so the shards stay disjoint; upstream replays epoch 0's order until
    the caller calls set_epoch. The caller's set_epoch(e) before a pass wins, even for the
    epoch last used (a replay). A pass left unfinished (a rank-0-only peek at one batch to
    log it) does not move it: counting every iter() call put that rank on another
    permutation than the others, and the next epoch's shards overlapped. A sampler given by
    the caller (data_sampler=) is left alone: set_epoch is theirs to call."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        pin_memory: bool = False,
        local_rank: int = 0,
        tput_timer: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
        data_sampler: Any = None,
        data_parallel_world_size: int | None = None,
        data_parallel_rank: int | None = None,
        dataloader_drop_last: bool = False,
        deepspeed_dataloader_config: dict[str, Any] | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if deepspeed_dataloader_config:
            raise ValueError(
                "DeepSpeedDataLoader: deepspeed_dataloader_config (data efficiency's "
                "curriculum sampling) is not built yet; leave it out"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.local_rank = local_rank
        self.tput_timer = tput_timer
        self.pin_memory = pin_memory
        self.num_local_io_workers = int(num_local_io_workers or 0)
        self.dataloader_drop_last = bool(dataloader_drop_last)
        self.post_process_func: Callable[..., Any] | None = None  # upstream's hook, unset
        self._own_sampler = data_sampler is None
        if data_sampler is None:
            world, rank = data_parallel_world_size, data_parallel_rank
            data_sampler = _OwnSampler(
                dataset,
                num_replicas=world,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=False,  # as upstream: the sampler pads; only a short last batch drops
            )
        self.data_sampler = self.sampler = data_sampler
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=self.num_local_io_workers,
            drop_last=self.dataloader_drop_last,
            pin_memory=pin_memory,
        )
        self.len = len(self.loader)
        self.epoch = 0
        self.data: _Pass | None = None  # the pass under way (upstream's name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._own_sampler:
            sampler = self.sampler
            if sampler.caller_set:  # the caller's set_epoch (upstream's way) wins
                self.epoch = sampler.epoch
            sampler.use_epoch(self.epoch)
        self.data = _Pass(self)
        return self.data

    def __next__(self) -> Any:
        """Upstream's loader is its own iterator: next() goes on with the pass under way
        (starting one if none is)."""
        if self.data is None:
            iter(self)
        assert self.data is not None
        try:
            return next(self.data)
        except StopIteration:
            self.data = None
            raise


class _OwnSampler(DistributedSampler):
    """The loader's own sampler: it tells the caller's set_epoch from the loader's."""

    caller_set = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.caller_set = True

    def use_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.caller_set = False


class _Pass:
    """One pass over the loader (len() as the DataLoader's iterator has it); the loader's
    epoch moves on when the pass ends ([Note: epochs of the loader])."""

    def __init__(self, owner: DeepSpeedDataLoader) -> None:
        self.owner = owner
        self.it = iter(owner.loader)
        self.ended = False

    def __iter__(self) -> _Pass:
        return self

    def __len__(self) -> int:
        return len(self.owner.loader)

    def __next__(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            if not self.ended:
                self.ended = True
                self.owner.epoch += 1
            raise


class RepeatingLoader:
    """Upstream's wrapper: iterate a loader forever, restarting it when it runs out (a
    pipeline pulls gradient_accumulation_steps micro-batches per train_batch())."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration again


def batch_tokens(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Tokens of a forward call, for the metrics line: the elements of its first integer
    2-D tensor (token ids, [batch, seq] or [seq, batch]) anywhere in the arguments (a
    tuple, list or dict batch too); None when it has none."""
    for x in tree_leaves((inputs, kwargs)):
        if torch.is_tensor(x) and x.dim() == 2 and not (x.is_floating_point() or x.is_complex()):
            return int(x.numel()) if x.dtype != torch.bool else None  # a mask is no tokens
    return None

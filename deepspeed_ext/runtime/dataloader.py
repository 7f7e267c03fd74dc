"""The dataloader deepspeed.initialize returns when given training_data: a DistributedSampler
(each rank its own shard, reshuffled per epoch) and the micro-batch size from the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DeepSpeedDataLoader:
    """Upstream's attributes: dataset, batch_size, collate_fn, data_sampler (also .sampler),
    and len() in micro-batches.

    [Note: epochs of the loader]
    Each pass that runs to its end moves the sampler to the next epoch (a new shuffle, the
    same on every rank), so the shards stay disjoint. A pass left unfinished (a rank-0-only
    peek at one batch to log it) does not: counting every iter() call put that rank on
    another permutation than the others, and the next epoch's shards overlapped. A sampler
    given by the caller (data_sampler=) is left alone: set_epoch is theirs to call."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[..., Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool = False,
        data_sampler: Any = None,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self._own_sampler = data_sampler is None
        if data_sampler is None:
            data_sampler = DistributedSampler(
                dataset,
                num_replicas=world_size,
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
            num_workers=num_workers,
            drop_last=drop_last,
            pin_memory=pin_memory,
        )
        self.epoch = 0
        self._set = 0  # the epoch this loader last gave its sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._own_sampler:
            if getattr(self.sampler, "epoch", self._set) != self._set:
                self.epoch = self.sampler.epoch  # the caller's set_epoch (upstream's way) wins
            self.sampler.set_epoch(self.epoch)
            self._set = self.epoch
        return _Pass(self)


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

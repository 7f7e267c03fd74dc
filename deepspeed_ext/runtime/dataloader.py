"""The dataloader deepspeed.initialize returns when given training_data: a DistributedSampler
(each rank its own shard, reshuffled per epoch) and the micro-batch size from the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DeepSpeedDataLoader:
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
    ) -> None:
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,  # as upstream: the sampler pads; only a short last batch drops
        )
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            drop_last=drop_last,
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


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

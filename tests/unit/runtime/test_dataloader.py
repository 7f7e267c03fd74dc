"""DeepSpeedDataLoader with upstream's constructor and iteration, and its epochs
([Note: epochs of the loader]); deepspeed_io's eval route reads in order, as upstream's."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from deepspeed_ext.runtime.dataloader import DeepSpeedDataLoader
from tests.helpers.distributed import run_ranks

DATA = TensorDataset(torch.arange(8))


def _order(loader: DeepSpeedDataLoader) -> list[int]:
    return [int(v) for (b,) in loader for v in b]


def _permutation(epoch: int) -> list[int]:
    """torch's DistributedSampler order for one rank of one at seed 0."""
    g = torch.Generator()
    g.manual_seed(epoch)
    return torch.randperm(8, generator=g).tolist()


def _loader(**kw: object) -> DeepSpeedDataLoader:
    # upstream's keywords, as code written for it builds one
    return DeepSpeedDataLoader(
        dataset=DATA,
        batch_size=4,
        pin_memory=False,
        local_rank=0,
        tput_timer=None,
        data_parallel_world_size=1,
        data_parallel_rank=0,
        **kw,  # type: ignore[arg-type]
    )


def test_the_callers_set_epoch_wins_even_for_the_epoch_just_used() -> None:
    loader = _loader()
    orders = []
    for epoch in (0, 0, 5, 5):  # a replay of an epoch, as upstream gives it
        loader.data_sampler.set_epoch(epoch)
        orders.append(_order(loader))
    assert orders == [_permutation(e) for e in (0, 0, 5, 5)]


def test_passes_without_set_epoch_move_to_the_next_epoch() -> None:
    loader = _loader()
    assert [_order(loader) for _ in range(3)] == [_permutation(e) for e in (0, 1, 2)]


def test_upstreams_attributes_and_next_on_the_loader_itself() -> None:
    loader = _loader(num_local_io_workers=0, dataloader_drop_last=True)
    assert (loader.len, loader.num_local_io_workers, loader.dataloader_drop_last) == (2, 0, True)
    assert loader.pin_memory is False and loader.post_process_func is None
    first, second = next(loader), next(loader)  # a pass started by next()
    assert [int(v) for v in torch.cat([first[0], second[0]])] == _permutation(0)


def _eval_orders() -> list[list[int]]:
    import deepspeed

    engine, *_ = deepspeed.initialize(
        model=torch.nn.Linear(1, 1), config={"train_micro_batch_size_per_gpu": 2}
    )
    return [_order(engine.deepspeed_io(DATA, route=r)) for r in ("eval", "predict")]


def test_the_eval_and_predict_routes_read_in_order() -> None:
    for rank, orders in enumerate(run_ranks(_eval_orders, 2)):
        assert orders == [list(range(rank, 8, 2))] * 2, orders  # each rank its strided shard

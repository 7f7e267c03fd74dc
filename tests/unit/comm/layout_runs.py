"""Rank functions for the layout tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def grid_groups(shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """For each (pipe, data, tensor) shape: this rank's group ranks as torch sees them, and
    the sum of global ranks all-reduced over the data group (proves the group is real)."""
    from deepspeed_ext.comm import (
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
        init_distributed,
    )
    from deepspeed_ext.comm.layout import set_current

    init_distributed(verbose=False)
    out = []
    for p, d, t in shapes:
        grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=p, num_mp=t, num_dp=d))
        set_current(grid.layout)
        from deepspeed_ext.comm import groups

        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=grid.get_data_parallel_group())
        out.append(
            {
                "data": dist.get_process_group_ranks(grid.get_data_parallel_group()),
                "pipe": dist.get_process_group_ranks(grid.get_pipe_parallel_group()),
                "tensor": dist.get_process_group_ranks(grid.get_slice_parallel_group()),
                "model": dist.get_process_group_ranks(grid.get_model_parallel_group()),
                "dp_sum": float(x),
                "stage": grid.get_stage_id(),
                "first_last": (grid.is_first_stage, grid.is_last_stage),
                "accessors": (
                    groups.get_data_parallel_world_size(),
                    groups.get_tensor_model_parallel_world_size(),
                    groups.get_pipe_parallel_world_size(),
                    groups.get_data_parallel_rank(),
                ),
                "next_stage": grid.p2p_groups[dist.get_rank()][1],
                "many": [_broadcast_many(grid.layout.data, b) for b in (1 << 20, 40)],
            }
        )
    set_current(None)
    return out


def _broadcast_many(group: Any, bucket_bytes: int) -> list[list[float]]:
    """Tensors of mixed dtypes, a transposed view, an empty one and ones over the bucket
    size, each filled with this rank's number, broadcast from the group's first rank."""
    from deepspeed_ext.comm import collective_device, group_broadcast_many

    r, dev = dist.get_rank(), collective_device(group)
    ts = [
        torch.full((3, 4), float(r), device=dev),
        torch.full((4, 3), float(r) + 0.5, device=dev).t(),  # a view: written back through it
        torch.tensor(r, dtype=torch.int64, device=dev),
        torch.empty(0, device=dev),
        torch.full((20,), float(r), dtype=torch.bfloat16, device=dev),
        torch.full((5,), r % 2 == 1, device=dev),
        torch.full((2,), float(r) + 0.25, device=dev),
    ]
    group_broadcast_many(ts, group, bucket_bytes=bucket_bytes)
    assert not ts[1].is_contiguous()
    return [t.float().reshape(-1).tolist() for t in ts]


class ReplicaMpu:
    """A Megatron-style mpu over 4 ranks: tensor-parallel 2 (ranks 0,1 and 2,3) x
    data-parallel 2 (ranks 0,2 and 1,3). The model is not sliced: each tensor rank trains an
    independent replica over its own data-parallel group, so ZeRO must partition and reduce
    over that group, not the world. Groups are made here with torch, not with our layout."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        for ranks in ([0, 2], [1, 3]):
            g = dist.new_group(ranks)
            if rank in ranks:
                self.dp, self.dp_ranks = g, ranks
        for ranks in ([0, 1], [2, 3]):
            g = dist.new_group(ranks)
            if rank in ranks:
                self.tp, self.tp_ranks = g, ranks

    def get_data_parallel_group(self) -> Any:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_group(self) -> Any:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return 2


def replicas(stages: list[int]) -> dict[int, dict]:
    """4 ranks with ReplicaMpu: replica v (the tensor rank) trains on data variant v."""
    from deepspeed_ext.comm import init_distributed
    from tests.unit.zero.zero_runs import train

    init_distributed(verbose=False)
    mpu = ReplicaMpu()
    v, dp_rank = mpu.get_model_parallel_rank(), mpu.get_data_parallel_rank()
    out: dict[int, dict] = {s: train(s, data_rank=100 * v + dp_rank, mpu=mpu) for s in stages}
    out[30] = train(3, data_rank=100 * v + dp_rank, mpu=mpu, zero_init=True)
    out[-1] = {"v": v, "dp": dp_rank}
    return out


def references(stages: list[int]) -> dict[tuple[int, int], dict]:
    """2 plain data-parallel ranks, each data variant in turn."""
    import os

    from tests.unit.zero.zero_runs import train

    rank = int(os.environ["RANK"])
    return {(s, v): train(s, data_rank=100 * v + rank) for s in stages for v in (0, 1)}


def replica_checkpoints(root: str, stages: list[int]) -> dict[int, float]:
    """ReplicaMpu, each model-parallel rank with weights of its own (as a Megatron model's
    slices are): a checkpoint loads back each rank's own weights, at every ZeRO stage. The
    model slices itself, so no AutoTP table is saved."""
    from deepspeed_ext.comm import init_distributed
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters

    init_distributed(verbose=False)
    mpu = ReplicaMpu()
    out = {}

    def weights(engine: Any) -> dict[str, torch.Tensor]:
        with GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    for stage in stages:
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
        }
        engines = []
        for seed in (mpu.get_model_parallel_rank(), 7):  # the saver's own; any other
            torch.manual_seed(seed)
            net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
            )
            engine, *_ = initialize(model=net, config=cfg, mpu=mpu)
            engines.append(engine)
        saver, loader = engines
        saver.save_checkpoint(f"{root}/zero{stage}", tag="t")
        loader.load_checkpoint(f"{root}/zero{stage}", tag="t")
        want, got = weights(saver), weights(loader)
        out[stage] = max(float((got[n] - want[n]).abs().max()) for n in want)
        for e in engines:
            e.destroy()
    return out

"""Rank functions for test_sharded.py (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def _bucket(rank: int, numel: int, seed: int) -> torch.Tensor:
    """Every rank can make every rank's bucket; integer values keep each sum exact. On the
    device (the CPU, named) as a ZeRO bucket is: the suite's device-strict mode checks it."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-64, 64, (numel,), generator=g).float().to(CPU)


def exchanges(sizes: list[int], piece: int, whole: int, budget: int) -> dict[str, Any]:
    """Reduce-scatters and all-gathers over the world and over the subgroup of ranks 0 and 2
    (group ranks differ from global ranks there), several in flight together, waited in
    reverse order; the exchange's piece and whole-bucket sizes and its budget for the scratch
    of the exchanges in flight shrunk (bytes), so that big buckets go in many pieces and the
    budget completes older exchanges early."""
    from deepspeed_ext.comm import (
        all_gather_bucket,
        exchange,
        init_distributed,
        reduce_scatter_bucket,
    )
    from deepspeed_ext.comm.layout import axis_of

    init_distributed(verbose=False)
    exchange._PIECE_BYTES, exchange._WHOLE_BYTES, exchange._SCRATCH_MAX = piece, whole, budget
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 2])
    out: dict[str, Any] = {"errors": [], "scratch": [], "in_flight": []}

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            out["errors"].append(f"{name}: max diff {(got - want).abs().max().item()}")

    groups = [("world", None, list(range(world)))]
    if rank in (0, 2):
        groups.append(("pair", pair, [0, 2]))
    for gname, group, members in groups:
        w, me = len(members), members.index(rank)
        pending = []
        for i, n in enumerate(sizes):
            numel = n * w
            mine = _bucket(rank, numel, i)
            total = sum(_bucket(r, numel, i) for r in members)
            shard = torch.empty(n, device=CPU)
            work = reduce_scatter_bucket(shard, mine, group=group)
            used = sum(b.numel() * b.element_size() for b in work.scratch)
            out["scratch"].append((w, n, used))
            out["in_flight"].append(exchange.scratch_in_flight(tuple(members)))
            pending.append((work, shard, total[me * n : (me + 1) * n], f"{gname} rs {n}"))
        for work, shard, want, name in reversed(pending):
            work.wait()
            check(name, shard, want)
        for i, n in enumerate(sizes):
            full = _bucket(0, n * w, 50 + i)  # the same on every rank: the chunks are known
            bucket = torch.full((n * w,), float("nan"), device=CPU)
            chunk = full[me * n : (me + 1) * n].clone()
            all_gather_bucket(bucket, chunk, group=group).wait()
            check(f"{gname} ag {n}", bucket, full)
            bucket = full.clone()  # this rank's chunk already in place (a view)
            bucket[: me * n] = float("nan")
            bucket[(me + 1) * n :] = float("nan")
            all_gather_bucket(bucket, bucket[me * n : (me + 1) * n], group=group).wait()
            check(f"{gname} ag in place {n}", bucket, full)
    out["axis"] = axis_of(pair).ranks if rank in (0, 2) else None
    # node sizes: agreed (the same LOCAL_WORLD_SIZE everywhere: one node of 3), then not
    world = axis_of(None)
    exchange.forget()
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    agreed = exchange.pays(world, None)
    exchange.forget()
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == 2 else "2"
    out["pays"] = (agreed, exchange.pays(world, None))
    return out

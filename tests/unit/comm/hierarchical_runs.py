"""Rank bodies for test_hierarchical.py."""

from __future__ import annotations

from typing import Any

import torch


def sums(per_node: int) -> dict[str, Any]:
    """Hierarchical sums of integer-valued buffers (exact in any order) against the flat one."""
    import random
    import time

    from deepspeed_ext import comm
    from deepspeed_ext.comm.hierarchical import HierarchicalWork, advance
    from deepspeed_ext.comm.layout import axis_of

    comm.init_distributed()
    rank = comm.get_rank()
    axis = axis_of(None)
    groups, why = comm.node_groups(axis, per_node)
    out: dict[str, Any] = {"why": why, "groups": None}
    if groups is None:
        return out
    out["groups"] = (groups.local.ranks, groups.cross.ranks, groups.gather.ranks, groups.pieces)
    equal = []
    for n in (1, 7, 1001, 4096):
        x = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(n + rank))
        dev = comm.collective_device(None)
        flat, hier = x.float().to(dev), x.float().to(dev)
        torch.distributed.all_reduce(flat)
        HierarchicalWork(hier, groups, segments=3 if n > 8 else 0).wait()  # in segments
        equal.append(torch.equal(flat, hier))
    # many buckets in flight, each rank advancing them at its own moments (as backward
    # hands in gradients): every group must still see its collectives in one order
    rng = random.Random(rank)
    bufs, works = [], []
    for b in range(6):
        x = torch.randint(-50, 50, (500 + 300 * b,), generator=torch.Generator().manual_seed(b))
        bufs.append(x.float().to(dev))
        works.append(HierarchicalWork(bufs[-1], groups, segments=1 + b % 3))
        time.sleep(rng.random() * 0.005)
        advance([seg for w in works for seg in w.segments])
    for w in works:
        w.wait()
    for b, buf in enumerate(bufs):
        x = torch.randint(-50, 50, (500 + 300 * b,), generator=torch.Generator().manual_seed(b))
        equal.append(torch.equal(buf, x.float().to(dev) * axis.size))
    out["equal"] = equal
    out["scatter_equal"] = _scatters(groups, axis, rank, dev)
    return out


def _scatters(groups: Any, axis: Any, rank: int, dev: Any) -> list[bool]:
    """[Note: hierarchical reduce-scatter] against the flat reduce-scatter: one column, 2-3
    segments of ragged columns, 16 segments, out apart and in place, buckets in flight
    together; then again with every exchange cut into pieces (moved only inside wait())."""
    from deepspeed_ext import comm
    from deepspeed_ext.comm import exchange, hierarchical

    saved = hierarchical._SEGMENT, exchange._WHOLE_BYTES, exchange._PIECE_BYTES
    hierarchical._SEGMENT = 64  # elements: small buckets in several segments
    w = axis.size
    equal = []
    try:
        for pieces in (False, True):
            if pieces:  # 16 columns a piece
                exchange._WHOLE_BYTES, exchange._PIECE_BYTES = 64, 64
            cases = [(w, False), (w * 37, True), (w * 1001, False), (w * 1001, True)]
            works, checks = [], []
            for n, in_place in cases:
                x = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(n + rank))
                flat, hier = x.float().to(dev), x.float().to(dev)
                c = n // w
                want = torch.empty(c, device=dev)
                comm.reduce_scatter_bucket(want, flat, group=axis).wait()
                got = (
                    hier[axis.rank * c : (axis.rank + 1) * c]
                    if in_place
                    else torch.empty_like(want)
                )
                works.append(comm.reduce_scatter_bucket_hierarchical(got, hier, groups))
                checks.append((got, want))
            for work in works:  # in flight together, waited in launch order
                work.wait()
                work.wait()  # a second wait is a no-op
            equal += [torch.equal(got, want) for got, want in checks]
    finally:
        hierarchical._SEGMENT, exchange._WHOLE_BYTES, exchange._PIECE_BYTES = saved
    return equal


def _config(topology: str, **extra: Any) -> dict[str, Any]:
    hierarchical = {"topology": topology, "ranks_per_node": 2}
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "communication": hierarchical if topology == "hierarchical" else {},
        **extra,
    }


def engines() -> dict[str, Any]:
    """The same training with the flat and the hierarchical gradient all-reduce."""
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.runtime.models import batch, loss_fn, mlp

    out = {}
    for topology in ("flat", "hierarchical"):
        engine, *_ = initialize(model=mlp(), config=_config(topology))
        for s in range(6):
            x, y = batch(s, engine.dp_rank)
            engine.backward(loss_fn(engine, x, y))
            engine.step()
        out[topology] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out[f"{topology}_uses_nodes"] = engine.strategy.grads.buckets.hierarchy is not None
        engine.destroy()
    return out


def zero_engines() -> dict[str, Any]:
    """ZeRO 2 and 3 with the flat and the hierarchical topology: parameters, and how many
    buckets each way of reducing moved (counted at the comm functions)."""
    from deepspeed_ext import comm
    from deepspeed_ext.runtime.initialize import initialize
    from tests.helpers.counting import count_calls
    from tests.unit.runtime.models import batch, loss_fn, mlp

    counts = count_calls(comm, ["reduce_scatter_bucket_hierarchical", "reduce_scatter_bucket"])
    out: dict[str, Any] = {}
    for stage in (2, 3):
        for topology in ("flat", "hierarchical"):
            for k in counts:
                counts[k] = 0
            zero = {"stage": stage, "reduce_bucket_size": 200}
            engine, *_ = initialize(model=mlp(), config=_config(topology, zero_optimization=zero))
            for s in range(4):
                x, y = batch(s, engine.dp_rank)
                engine.backward(loss_fn(engine, x, y))
                engine.step()
            from deepspeed_ext.zero.stage3 import GatheredParameters

            with GatheredParameters(list(engine.module.parameters())):
                params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            out[f"{stage}_{topology}"] = params
            # buckets the reducer handed to each (the two steps' inner calls are not counted)
            out[f"{stage}_{topology}_counts"] = dict(counts)
            engine.destroy()
    return out

"""Rank bodies for test_face.py (spawned by run_ranks, 2 gloo ranks): upstream's
deepspeed.comm calls, each result kept (or the error it raised) for the test to check."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def face_checks() -> dict[str, Any]:
    # a user's CPU job on gloo: the host tensors it makes are what every collective takes
    # (the suite's device-strict mode would refuse them as NCCL would)
    os.environ["DS_EXT_DEVICE_STRICT"] = "0"
    import deepspeed.comm as dist

    dist.init_distributed(dist_backend="gloo")
    r = dist.get_rank()
    out: dict[str, Any] = {"rank": r}

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - the test names what failed
            out[name] = f"ERROR {type(e).__name__}: {e}"
        dist.barrier()

    # 1. all_gather with async_op
    def all_gather_async() -> Any:
        got = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(got, torch.full((2,), float(r)), async_op=True).wait()
        return got

    check("all_gather_async", all_gather_async)

    # 2. async_op=True on a group of one rank: a handle whose wait() works
    solo = dist.new_group([0])

    def solo_async() -> Any:
        if r != 0:
            return None
        x = torch.arange(3.0)
        res = {}
        calls = {
            "all_reduce": lambda: dist.all_reduce(x, group=solo, async_op=True),
            "inference_all_reduce": lambda: dist.inference_all_reduce(x, group=solo, async_op=True),
            "broadcast": lambda: dist.broadcast(x, 0, group=solo, async_op=True),
            "reduce": lambda: dist.reduce(x, 0, group=solo, async_op=True),
            "all_gather": lambda: dist.all_gather([torch.empty(3)], x, group=solo, async_op=True),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
                torch.empty(3), x, group=solo, async_op=True
            ),
            "reduce_scatter": lambda: dist.reduce_scatter(
                torch.empty(3), [x.clone()], group=solo, async_op=True
            ),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
                torch.empty(3), x, group=solo, async_op=True
            ),
            "all_to_all_single": lambda: dist.all_to_all_single(
                torch.empty(3), x, group=solo, async_op=True
            ),
            "all_to_all": lambda: dist.all_to_all([torch.empty(3)], [x], group=solo, async_op=True),
            "gather": lambda: dist.gather(x, [torch.empty(3)], 0, group=solo, async_op=True),
            "scatter": lambda: dist.scatter(x, [x.clone()], 0, group=solo, async_op=True),
            "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(
                [x], group=solo, async_op=True
            ),
            "all_gather_coalesced": lambda: dist.all_gather_coalesced(
                [torch.empty(3)], [x], group=solo, async_op=True
            ),
        }
        for name, call in calls.items():
            try:
                h = call()
                h.wait()
                res[name] = ("ok", bool(h.is_completed()), x.tolist())
            except Exception as e:  # noqa: BLE001
                res[name] = f"ERROR {type(e).__name__}: {e}"
        return res

    check("solo_async", solo_async)

    # 3. upstream's other names
    g1 = dist.new_group([1])
    check("get_global_rank_g1", lambda: dist.get_global_rank(g1, 0) if r == 1 else None)
    check("get_global_rank_world", lambda: dist.get_global_rank(None, 1))
    check("ranks_world", lambda: dist.get_all_ranks_from_group())
    check("ranks_world_group", lambda: dist.get_all_ranks_from_group(dist.get_world_group()))
    check("ranks_g1", lambda: dist.get_all_ranks_from_group(g1) if r == 1 else None)
    check("world_group_is_torchs", lambda: dist.get_world_group() is torch.distributed.group.WORLD)
    check(
        "flags",
        lambda: (
            dist.is_available(),
            dist.has_all_gather_into_tensor(),
            dist.has_reduce_scatter_tensor(),
        ),
    )

    def all_to_all(async_op: bool) -> Any:
        got = [torch.zeros(2) for _ in range(2)]
        h = dist.all_to_all(
            got, [torch.full((2,), 10.0 * r + j) for j in range(2)], async_op=async_op
        )
        if async_op:
            h.wait()
        return got

    check("all_to_all", lambda: all_to_all(False))
    check("all_to_all_async", lambda: all_to_all(True))

    def coalesced_inputs() -> list[torch.Tensor]:
        return [
            torch.full((2,), 1.0 + r),
            torch.arange(3, dtype=torch.int64) * (r + 1),
            (torch.arange(8.0) * (r + 1))[::2],  # a strided view
            torch.full((2, 2), 3.0 * r).t(),
        ]

    def all_reduce_coalesced(async_op: bool) -> Any:
        ts = coalesced_inputs()
        h = dist.all_reduce_coalesced(ts, async_op=async_op)
        if async_op:
            h.wait()
        return ts

    check("all_reduce_coalesced", lambda: all_reduce_coalesced(False))
    check("all_reduce_coalesced_async", lambda: all_reduce_coalesced(True))

    def all_gather_coalesced(async_op: bool) -> Any:
        outs = [torch.zeros(4), torch.zeros(2, dtype=torch.int64)]
        ins = [torch.full((2,), 1.0 + r), torch.tensor([5 + r])]
        h = dist.all_gather_coalesced(outs, ins, async_op=async_op)
        if async_op:
            h.wait()
        return outs

    check("all_gather_coalesced", lambda: all_gather_coalesced(False))
    check("all_gather_coalesced_async", lambda: all_gather_coalesced(True))

    def batch_p2p() -> Any:
        got = torch.zeros(2)
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), 7.0 + r), 1 - r),
            dist.P2POp(dist.irecv, got, 1 - r),
        ]
        reqs = dist.batch_isend_irecv(ops)
        for q in reqs:
            q.wait()
        return len(reqs), got

    check("batch_isend_irecv", batch_p2p)

    def import_comm_comm() -> Any:
        import deepspeed.comm.comm as cc

        return cc.all_reduce is dist.all_reduce and cc.get_global_rank is dist.get_global_rank

    check("import_comm_comm", import_comm_comm)

    # 4. tensors that are not dense: a strided view and a transpose, sync and async
    def base(k: float) -> torch.Tensor:
        return torch.arange(8.0) + k * r

    def strided_all_reduce(async_op: bool) -> Any:
        b = base(1.0)
        h = dist.all_reduce(b[::2], async_op=async_op)
        if async_op:
            h.wait()
        return b

    check("all_reduce_strided", lambda: strided_all_reduce(False))
    check("all_reduce_strided_async", lambda: strided_all_reduce(True))

    def transposed_all_reduce(async_op: bool) -> Any:
        x = (torch.arange(6.0).view(2, 3) + r).t()
        h = dist.all_reduce(x, async_op=async_op)
        if async_op:
            h.wait()
        return x

    check("all_reduce_transposed", lambda: transposed_all_reduce(False))
    check("all_reduce_transposed_async", lambda: transposed_all_reduce(True))

    def strided_broadcast() -> Any:
        b = base(10.0)
        dist.broadcast(b[::2], src=1)
        return b

    check("broadcast_strided", strided_broadcast)

    def strided_reduce() -> Any:
        b = base(1.0)
        dist.reduce(b[1::2], dst=0)
        return b

    check("reduce_strided", strided_reduce)

    def strided_inference_all_reduce() -> Any:
        x = (torch.arange(6.0).view(2, 3) + r)[:, ::2]
        dist.inference_all_reduce(x)
        return x

    check("inference_all_reduce_strided", strided_inference_all_reduce)

    def strided_all_gather() -> Any:
        got = [torch.zeros(4) for _ in range(2)]
        dist.all_gather(got, base(1.0)[::2])
        return got

    check("all_gather_strided_input", strided_all_gather)
    return out

"""All-gathering partitioned parameters and releasing them (see [Note: stage-3 parameter]).

A gather of several parameters is one collective per dtype: every rank sends its shards
concatenated, and each parameter is copied out of the [W, S_total] result (one copy). A
parameter of at least LONE_NUMEL elements gets a collective of its own instead, whose result
is the parameter itself (no copy): big tensors amortize the call, small ones share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepspeed_ext.comm import all_gather_bucket

from .param import (
    ZeroParamStatus,
    ensure_storage,
    is_zero_param,
    read_shard,
    release,
    set_full,
    step_pending,
)

LONE_NUMEL = 1 << 20


class GatherHandle:
    """Pending all-gathers; wait() completes them and makes the parameters AVAILABLE."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, torch.Tensor, list[Any]]] = []
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        for work, recv, params in self.jobs:
            work.wait()
            world = params[0].ds_process_group.size
            if len(params) == 1 and recv is params[0].ds_flat:  # gathered in place
                set_full(params[0])
                params[0].ds_handle = None
                continue
            total = recv.numel() // world
            rows = recv.view(world, total)
            off = 0
            for p in params:
                s = p.ds_shard_numel
                ensure_storage(p)
                copy_rows(p.ds_flat[: p.ds_numel], rows[:, off : off + s])
                set_full(p)
                p.ds_handle = None
                off += s
        self.jobs.clear()


def copy_rows(flat: torch.Tensor, rows: torch.Tensor) -> None:
    """flat (N elements) <- rows ([W, S] view, row r = shard r) up to N: two copies at most."""
    n, s = flat.numel(), rows.shape[1]
    k = n // s
    if k:
        flat[: k * s].view(k, s).copy_(rows[:k])
    if n - k * s:
        flat[k * s :].copy_(rows[k, : n - k * s])


def gather_params(params: Iterable[Any], wait: bool = True) -> GatherHandle:
    """Gather every partitioned parameter in `params` that is not AVAILABLE. Parameters
    already in flight are waited for, not gathered twice."""
    handle = GatherHandle()
    todo: dict[tuple[torch.dtype, int], list[Any]] = {}  # (dtype, id(group)) -> params
    pending: list[GatherHandle] = []
    for p in params:
        if not is_zero_param(p):
            continue
        if p.ds_status is ZeroParamStatus.INFLIGHT:
            pending.append(p.ds_handle)
        elif p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            todo.setdefault((p.dtype, id(p.ds_process_group)), []).append(p)
    for group in todo.values():
        dp = group[0].ds_process_group
        lone = [p for p in group if p.ds_numel >= LONE_NUMEL]
        shared = [p for p in group if p.ds_numel < LONE_NUMEL]
        for batch in [[p] for p in lone] + ([shared] if shared else []):
            device = batch[0].ds_device
            # a shard read from NVMe sits in a read-ahead buffer that is reused once
            # released: copied off it synchronously; pending steps first, which may reuse
            # the memory of a value read before them ([Note: sub-group arenas])
            step_pending(batch)
            send = torch.cat(
                [read_shard(p).to(device, non_blocking=p.ds_swap is None) for p in batch]
            )
            for p in batch:
                if p.ds_swap is not None:
                    p.ds_swap.release(p)
            if len(batch) == 1:  # straight into the parameter's own buffer
                ensure_storage(batch[0])
                recv = batch[0].ds_flat
            else:
                recv = torch.empty(dp.size * send.numel(), dtype=send.dtype, device=device)
            handle.jobs.append((all_gather_bucket(recv, send, group=dp), recv, batch))
            for p in batch:
                p.ds_status = ZeroParamStatus.INFLIGHT
                p.ds_handle = handle
    if wait:
        for h in pending:
            h.wait()
        handle.wait()
    return handle


def release_params(params: Iterable[Any], force: bool = False) -> None:
    """Release gathered parameters nobody is using; persistent ones stay unless forced."""
    for p in params:
        if not is_zero_param(p) or p.ds_active > 0 or (p.ds_persist and not force):
            continue
        if p.ds_status is ZeroParamStatus.INFLIGHT:
            p.ds_handle.wait()
        release(p)

"""Rank bodies for test_device_strict.py (spawned: importable, module level)."""

from __future__ import annotations

import os

import torch


def _raises(fn) -> str:  # type: ignore[no-untyped-def]
    from deepspeed_ext.accelerator.strict import StrictDeviceError

    try:
        fn()
    except StrictDeviceError as exc:
        return str(exc)
    return ""


def strict_collectives() -> dict[str, object]:
    """What device-strict mode refuses and lets through over a real 2-rank process group."""
    os.environ["DS_EXT_DEVICE_STRICT"] = "1"
    from deepspeed_ext import comm
    from deepspeed_ext.accelerator import get_accelerator, strict

    comm.init_distributed()
    dev = comm.collective_device()
    out: dict[str, object] = {"active": strict.active()}
    # a tensor made without a device would be on the host beside a GPU: NCCL refuses it
    out["host_refused"] = _raises(lambda: comm.all_reduce(torch.ones(3)))
    # ... and so does anything computed only from host tensors
    out["derived_refused"] = _raises(lambda: comm.all_reduce(torch.ones(3) * 2))
    ok = torch.ones(3, device=dev)
    comm.all_reduce(ok)
    out["device_sum"] = ok.tolist()
    moved = torch.ones(3).to(dev)  # moved to the device explicitly
    comm.all_reduce(moved)
    out["moved_sum"] = moved.tolist()
    # a gloo side group is a host group: host tensors are right there
    side = comm.new_group([0, 1], backend="gloo")
    host = torch.ones(3)
    comm.all_reduce(host, group=side)
    out["side_sum"] = host.tolist()
    out["side_device"] = str(comm.collective_device(side))
    out["sums_over"] = comm.sums_over([1.0, 2.5])
    # an async copy into a host buffer may still be in flight: reading it is refused until
    # an event recorded after it is synchronized
    buf = strict.mark_host(torch.empty(3, device=dev))
    buf.copy_(ok, non_blocking=True)
    out["pending_read_refused"] = _raises(lambda: float(buf.sum()))
    out["pending_collective_refused"] = _raises(lambda: comm.all_reduce(buf, group=side))
    ev = get_accelerator().Event()
    ev.record()
    ev.synchronize()
    out["after_event"] = float(buf.sum())
    buf.copy_(ok, non_blocking=True)
    get_accelerator().synchronize()
    out["after_synchronize"] = float(buf.sum())
    # a non-contiguous tensor (a slice of a batch): gloo would move the wrong elements
    sliced = torch.arange(12.0, device=dev).view(3, 4)[:, 1:]
    try:
        comm.all_reduce(sliced)
        out["sliced_refused"] = ""
    except ValueError as exc:
        out["sliced_refused"] = str(exc)
    # torch fills an all-gather's output views itself: those pass
    rank = int(os.environ["RANK"])
    into = torch.zeros(3, 2, device=dev)
    comm.all_gather(list(into.t()), torch.full((3,), float(rank), device=dev))
    out["gathered_into_views"] = into.t().tolist()
    # a transposed parameter broadcast by the comm layer goes through a dense copy
    from deepspeed_ext.comm.layout import AxisGroup

    w = (torch.arange(6.0, device=dev).view(2, 3) * (rank + 1)).t()
    comm.group_broadcast(w, AxisGroup(None, (0, 1), rank))
    out["broadcast_view"] = w.tolist()
    nhwc = torch.ones(1, 2, 2, 3, device=dev).to(memory_format=torch.channels_last)
    comm.all_reduce(nhwc)  # channels-last is dense: NCCL takes it, and so does gloo
    out["channels_last_sum"] = float(nhwc.sum())
    comm.barrier()
    return out

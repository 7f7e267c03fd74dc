"""Rank bodies for test_comms_logger.py (spawned by run_ranks)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import torch


def issue_known_collectives() -> dict[str, Any]:
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    deepspeed.comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
    dev = comm.collective_device(None)
    x = torch.ones(256, device=dev)  # 1 KiB
    for _ in range(3):
        comm.all_reduce(x)
    out = torch.empty(512, device=dev)
    for _ in range(2):
        deepspeed.comm.all_gather_into_tensor(out, x)
    deepspeed.comm.reduce_scatter_tensor(torch.empty(128, device=dev), x)
    comm.broadcast(x, src=0)
    comm.all_reduce(x, async_op=True).wait()
    logged = comm.comms_logger.summary_rows()

    # only the ops asked for
    comm.comms_logger.reset_data()
    deepspeed.comm.configure(prof_all=False, prof_ops=["broadcast"], debug=True)
    comm.all_reduce(x)
    comm.broadcast(x, src=0)
    only = comm.comms_logger.get_operation_names()

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        table = deepspeed.comm.log_summary(show_straggler=True, return_dict=True)
    deepspeed.comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    return {"logged": logged, "only": only, "printed": printed.getvalue(), "table": table}


def engine_logs_its_collectives(out_dir: str) -> dict[str, Any]:
    from deepspeed_ext import comm
    from deepspeed_ext.runtime.initialize import initialize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    engine, *_ = initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1},
            "steps_per_print": 1,
            "comms_logger": {"enabled": True},
            "jsonl_monitor": {"enabled": True, "output_path": out_dir, "job_name": "j"},
        },
    )
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 16)).square().mean())
        engine.step()
    engine.destroy()
    names = comm.comms_logger.get_operation_names()
    lines = []
    path = Path(out_dir) / "j" / "metrics.jsonl"
    if path.exists():
        lines = [json.loads(x) for x in path.read_text().splitlines()]
    comm.configure(enabled=False)
    return {"names": names, "metrics": lines}


def zero_buckets_log_as_one_collective() -> dict[str, Any]:
    """ZeRO's bucket collectives on gloo, made of point-to-point exchanges and per-rank
    broadcasts ([Note: in-place collectives on gloo]): one row each, under the name of the
    collective they stand for."""
    from deepspeed_ext import comm
    from deepspeed_ext.comm.sharded import all_gather_bucket, reduce_scatter_bucket

    comm.init_distributed()
    rank, dev = comm.get_rank(), comm.collective_device(None)  # a ZeRO bucket's device
    small = torch.arange(2048, dtype=torch.float32, device=dev) + rank  # received whole
    big = torch.full((2 * 1_200_000,), rank + 1.0, device=dev)  # over 4 MB a peer: in pieces
    reduce_scatter_bucket(torch.empty(1024, device=dev), small.clone()).wait()  # nodes agreed
    comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
    out = torch.empty(1024, device=dev)
    for _ in range(2):
        reduce_scatter_bucket(out, small.clone()).wait()
    big_out = torch.empty(1_200_000, device=dev)
    reduce_scatter_bucket(big_out, big).wait()
    gathered = torch.empty(2048, device=dev)
    all_gather_bucket(gathered, out).wait()
    rows = comm.comms_logger.summary_rows()
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    return {
        "rows": {k: {s: v["count"] for s, v in sizes.items()} for k, sizes in rows.items()},
        "out": out,
        "big_out": big_out,
        "gathered": gathered,
    }


def hierarchical_sums_log_as_one_collective() -> dict[str, Any]:
    """The hierarchical all-reduce and reduce-scatter (4 ranks as 2 nodes of 2): one row each,
    of the whole buffer, not rows of their steps on the node groups."""
    from deepspeed_ext import comm
    from deepspeed_ext.comm.hierarchical import all_reduce_hierarchical
    from deepspeed_ext.comm.layout import axis_of

    comm.init_distributed()
    rank, dev = comm.get_rank(), comm.collective_device(None)
    groups, _ = comm.node_groups(axis_of(None), 2)
    comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
    buf = torch.arange(4096, dtype=torch.float32, device=dev) + rank
    all_reduce_hierarchical(buf, groups).wait()
    out = torch.empty(1024, device=dev)
    comm.reduce_scatter_bucket_hierarchical(out, torch.ones(4096, device=dev), groups).wait()
    rows = comm.comms_logger.summary_rows()
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    return {
        "rows": {k: {s: v["count"] for s, v in sizes.items()} for k, sizes in rows.items()},
        "sum_ok": torch.equal(buf, 4 * torch.arange(4096, dtype=torch.float32, device=dev) + 6),
        "scatter_ok": bool((out == 4).all()),
    }

"""The comms logger counts what was issued, sizes and bandwidths as defined in
[Note: comms logger], on real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepspeed_ext.comm.checked import ALL_GATHER_OP, REDUCE_SCATTER_OP
from deepspeed_ext.comm.comms_logging import (
    CommsLogger,
    bus_factor,
    message_bytes,
    size_string,
)
from tests.helpers.distributed import run_ranks

from . import comms_logger_runs as runs

KIB = 1024


def test_message_size_is_the_whole_buffer_and_busbw_follows_nccl_tests() -> None:
    x = torch.ones(256)
    assert message_bytes("all_reduce", (x,), {}, 4) == KIB
    assert message_bytes("all_gather_into_tensor", (torch.empty(1024), x), {}, 4) == 4 * KIB
    assert message_bytes("all_gather", ([x] * 4, x), {}, 4) == 4 * KIB
    assert message_bytes("reduce_scatter_tensor", (torch.empty(64), x), {}, 4) == KIB
    assert message_bytes("gather", (x,), {}, 4) == 4 * KIB
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather_into_tensor", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 1.0
    assert size_string(KIB) == "1 KB" and size_string(3 * 2**20 // 2) == "1.5 MB"


def test_bad_settings_name_themselves() -> None:
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['prof_everything'\]"):
        CommsLogger().configure(None, prof_everything=True)


def test_two_ranks_log_what_they_issued() -> None:
    for r in run_ranks(runs.issue_known_collectives, 2, timeout=120):
        logged = r["logged"]
        assert {k: {s: v["count"] for s, v in sizes.items()} for k, sizes in logged.items()} == {
            "all_reduce": {KIB: 4},  # 3 + 1 async, waited on
            "all_gather_into_tensor": {2 * KIB: 2},
            "reduce_scatter_tensor": {KIB: 1},
            "broadcast": {KIB: 1},
        }
        for name, sizes in logged.items():
            for row in sizes.values():
                assert row["total_latency_ms"] > 0
                factor = bus_factor(name, 2)
                assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        # prof_all off, prof_ops=["broadcast"], debug: the caller's name is in the record
        assert r["only"] == ["broadcast | [Caller Func: issue_known_collectives]"]
        assert "straggler_ms" in next(iter(r["table"].values()))[KIB]
    rank0, rank1 = (r["printed"] for r in run_ranks(runs.issue_known_collectives, 2, timeout=120))
    assert "Comm. Op" in rank0 and "broadcast | [Caller Func" in rank0 and rank1 == ""


def test_zero_buckets_on_gloo_log_as_the_collective_they_stand_for() -> None:
    """Not as the isend/irecv and broadcast calls they are made of: a user reads the rows
    ZeRO's reduce-scatter and all-gather would make on NCCL, with their sizes and busbw."""
    small_bytes, big_bytes = 2048 * 4, 2_400_000 * 4
    r0, r1 = run_ranks(runs.zero_buckets_log_as_one_collective, 2, timeout=120)
    for r in (r0, r1):
        assert r["rows"] == {  # under the names NCCL's calls have on this torch
            REDUCE_SCATTER_OP: {small_bytes: 2, big_bytes: 1},
            ALL_GATHER_OP: {small_bytes: 1},
        }, r["rows"]
    ranks = torch.arange(2048, dtype=torch.float32)
    summed = 2 * ranks + 1  # rank r's bucket is arange + r
    assert torch.equal(r0["out"], summed[:1024]) and torch.equal(r1["out"], summed[1024:])
    assert bool((r0["big_out"] == 3).all()) and bool((r1["big_out"] == 3).all())
    assert torch.equal(r0["gathered"], summed) and torch.equal(r1["gathered"], summed)


def test_hierarchical_sums_log_as_the_collective_they_stand_for() -> None:
    """Not as the all-to-all, all-reduce, all-gather and exchanges on node groups they are
    made of ([Note: hierarchical all-reduce])."""
    for r in run_ranks(runs.hierarchical_sums_log_as_one_collective, 4, timeout=120):
        assert r["sum_ok"] and r["scatter_ok"], r
        assert r["rows"] == {"all_reduce": {4096 * 4: 1}, REDUCE_SCATTER_OP: {4096 * 4: 1}}, r


def test_the_engine_logs_its_gradient_collectives_and_reports_them_per_step(
    tmp_path: Path,
) -> None:
    r0, r1 = run_ranks(runs.engine_logs_its_collectives, 2, str(tmp_path), timeout=120)
    assert "all_reduce" in r0["names"], r0["names"]  # the gradients' reduction
    steps = [m for m in r0["metrics"] if "loss" in m]
    grad_bytes = 4 * (16 * 32 + 32 + 32 * 4 + 4)
    assert len(steps) == 2
    assert all(m["comm_ms"] > 0 and m["comm_mb"] * 2**20 >= grad_bytes for m in steps), steps
    assert r1["names"] == r0["names"]  # every rank logs its own collectives

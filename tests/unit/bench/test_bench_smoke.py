"""Benchmarks run in smoke mode (tiny sizes, no speed assertion) so they cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "script,args,result",
    [
        ("cpu_adam.py", ["--smoke", "--no-upstream"], "cpu_adam_smoke.json"),
        ("fused_adam.py", ["--smoke"], None),  # prints "skipped" without a GPU
        ("ddp_step.py", ["--smoke", "--no-upstream"], "ddp_step_smoke.json"),  # ~25 s
        ("zero_step.py", ["--smoke", "--no-upstream"], "zero_step_smoke.json"),  # ~35 s
        ("zero3_step.py", ["--smoke", "--no-upstream"], "zero3_step_smoke.json"),  # ~45 s
        ("aio.py", ["--smoke", "--dir", "{tmp}"], "aio_smoke.json"),  # ~2 s
        ("exit_soak.py", ["--smoke"], "exit_soak_smoke.json"),  # two 2-rank jobs, ~20 s
        ("pipeline_step.py", ["--smoke"], "pipeline_step_smoke.json"),  # four 4-rank jobs, ~40 s
        ("zero3_nvme.py", ["--smoke"], "zero3_nvme_smoke.json"),  # six 2-rank jobs, ~55 s
        ("kill_soak.py", ["--smoke"], "kill_soak_smoke.json"),  # seven 2-rank jobs, ~35 s
        ("config_fuzz.py", ["--smoke"], "config_fuzz_smoke.json"),  # ~5 s
        ("activation_checkpointing.py", ["--smoke"], "activation_checkpointing_smoke.json"),
        ("tp_step.py", ["--smoke"], "tp_step_smoke.json"),  # two 2-rank jobs, ~15 s
        # four 2-rank jobs: the two cases and their fp32 baselines
        (
            "compressed_comm.py",
            ["--smoke", "--cases", "onebit,gc-topk-z2"],
            "compressed_comm_smoke.json",
        ),
        ("hierarchical_allreduce.py", ["--smoke"], "hierarchical_allreduce_smoke.json"),
        ("pipe_partitioned.py", ["--smoke"], "pipe_partitioned_smoke.json"),  # one 4-rank job
        ("transformer_layer.py", ["--smoke"], "transformer_layer_smoke.json"),  # ~5 s
        ("sparse_attention.py", ["--smoke"], "sparse_attention_smoke.json"),  # ~10 s
    ],
)
def test_bench_smoke(script, args, result, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path / "io")) for a in args]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DS_BENCH_RESULTS": str(tmp_path)},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    if result == "ddp_step_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        for case in ("fp32", "bf16"):
            for impl in ("ours", "ddp"):  # two 2-rank jobs each; upstream skipped
                entry = data["contenders"][f"{impl} {case}"]
                assert entry["median_steps_per_s"] > 0, entry
                assert entry["threads_per_rank"] == 1, entry
            assert data["ratios"][case]["ddp"]["ours_over_peer"] > 0, data["ratios"]
        assert not data["leftover_pids_killed_at_end"], data["leftover_pids_killed_at_end"]
    elif result == "zero_step_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        names = [f"ours stage {s}" for s in (0, 1, 2)] + ["ours stage 2 + offload"]
        for name in [*names, "torch ZeRO-R (stage 1)"]:  # five 2-rank jobs; upstream skipped
            entry = data["contenders"][name]
            assert entry["median_steps_per_s"] > 0, entry
            assert entry["threads_per_rank"] == 1, entry
            assert len(entry["peak_rss_job_bytes"]) == 2, entry  # one per rank
            assert min(entry["peak_rss_steady_bytes"]) > 0, entry
        ratio = data["ratios"]["stage 1 vs zero_redundancy"]["ours_over_peer_steps_per_s"]
        assert ratio > 0, data["ratios"]
        assert not data["leftover_pids_killed_at_end"], data["leftover_pids_killed_at_end"]
    elif result == "zero3_step_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        names = [f"ours stage 3{c}" for c in ("", " partitioned", " + offload")]
        for name in [*names, "torch FSDP2 fully_shard"]:  # four 2-rank jobs; upstream skipped
            entry = data["contenders"][name]
            assert entry["median_steps_per_s"] > 0, entry
            assert entry["threads_per_rank"] == 1, entry
            assert len(entry["peak_rss_steady_bytes"]) == 2, entry  # one per rank
            assert entry["steady_above_base_over_target"] > 0, entry
        assert data["ratios"]["stage 3 vs fsdp2"]["ours_over_peer_steps_per_s"] > 0
        fixed = data["contenders"]["ours stage 3 partitioned"]["fixed_mmap"]  # the memory pass
        assert min(fixed["peak_rss_steady_bytes"]) > 0, fixed
        assert not data["leftover_pids_killed_at_end"], data["leftover_pids_killed_at_end"]
    elif result == "aio_smoke.json":
        res = json.loads((tmp_path / result).read_text())["results"]
        assert res["roundtrip_bit_exact"], res
        assert res["backend"] in ("io_uring", "threads"), res
        for kind in ("write", "read"):
            assert res["gbps"][kind]["ours"] > 0, res["gbps"]
            assert res["gbps"][kind]["ours threads"] > 0, res["gbps"]
            if not res["dd_skipped"]:
                assert res["ours_over_dd"][kind]["ours"] > 0, res["ours_over_dd"]
        assert not list((tmp_path / "io").iterdir())  # the bench file is removed
    elif result == "pipeline_step_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        for impl in ("ours", "torch"):  # 4 stages, emulated stage compute; upstream skipped
            entry = data["contenders"][f"{impl} emulated m=4"]
            assert entry["median_step_s"] > 0, entry
            assert 0 < entry["bubble"] < 1, entry
        assert data["ours_speedup"]["emulated m=4 vs torch"] > 0, data["ours_speedup"]
        zb = data["contenders"]["ours zb-h1 emulated m=4"]
        assert 0 < zb["idle_vs_1f1b"] < 1, zb  # the zero-bubble schedule idles less
        v = data["contenders"]["ours dualpipev emulated m=8"]
        assert 0 < v["bubble"] < 1 and v["bubble_formula"] is None, v
        assert not data["leftover_pids_killed_at_end"], data["leftover_pids_killed_at_end"]
    elif result == "zero3_nvme_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        assert set(data["step_s"]) == {
            "ours cpu offload",
            "ours nvme",
            "ours nvme, no read-ahead",
            "ours nvme, step in engine.step()",
            "ours nvme, pipelined optimizer",
            "ours nvme, steps in backward",
        }
        for key in (
            "nvme_over_cpu_offload_step_time",
            "in_step_nvme_over_cpu_offload_step_time",
            "pipelined_nvme_over_cpu_offload_step_time",
            "steps_in_backward_nvme_over_cpu_offload_step_time",
            "no_read_ahead_over_read_ahead_step_time",
        ):
            assert data["ratios"][key] > 0, data["ratios"]
        assert not data["leftover_pids_killed_at_end"], data["leftover_pids_killed_at_end"]
    elif result == "kill_soak_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        assert data["save_crashes_loadable"] == data["save_crashes_total"] == 4, data
        assert data["rank_kills_ok"] == 3, data["rank_kills"]
    elif result == "config_fuzz_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        for stage in ("validate", "initialize"):
            assert data[stage]["uncaught"] == data[stage]["unnamed"] == 0, data["failures"]
    elif result == "activation_checkpointing_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        rows = {r["variant"]: r for r in data["rows"]}
        assert {"ours full", "torch full", "ours non-reentrant", "ours 3-of-4"} <= set(rows), rows
        # bytes, not time: per-block checkpoints keep only the block inputs
        assert rows["ours full"]["activation_cut"] > 0.6, rows["ours full"]
        assert rows["ours full"]["autograd_saved_mb"] == rows["torch full"]["autograd_saved_mb"]
        # 3 of 4 blocks checkpointed keep more than all 4, less than none
        part = rows["ours 3-of-4"]["activation_cut"]
        assert 0.3 < part < rows["ours full"]["activation_cut"], rows["ours 3-of-4"]
    elif result == "tp_step_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        assert not data["failures"], data["failures"]
        for name in ("ours tp2", "ours tp1"):
            assert data["summary"][name]["step_s"] > 0, data["summary"]
        # bytes, not time: each rank holds its slices and the replicated weights, exactly
        assert data["ratios"]["ours tp2 held/formula"] == 1.0, data["ratios"]
    elif result == "compressed_comm_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        loop = data["summary"]["loopback"]  # smoke: no namespaces, no upstream
        assert loop["adam"]["median_step_s"] > 0 and loop["onebit"]["median_step_s"] > 0
        # bytes, not time: the signs are 1/32 of fp32 values (small tensors pad a little)
        assert 20 < loop["onebit"]["bytes_ratio"] <= 32, loop
        assert 0.9 < loop["onebit"]["loss_ratio"] < 1.1, loop
        # ZeRO 2 with top-k: the reduce-scatter shrinks, the fp32 parameter gather does not
        assert loop["gc-topk-z2"]["bytes_ratio"] > 1.5, loop
        assert 0.8 < loop["gc-topk-z2"]["loss_ratio"] < 1.2, loop
    elif result == "hierarchical_allreduce_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        (res,) = data["results"]  # timings only: the sums' equality is tests/unit/comm's
        assert res["ranks_per_node"] == 2 and res["median_s"]["hierarchical"] > 0, res
        assert res["median_s"]["rs_hierarchical"] > 0 and res["median_s"]["rs_flat"] > 0, res
    elif result == "transformer_layer_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        med = data["median_s"]
        assert med["deepspeed_ext fused layer"] > 0 and med["torch eager"] > 0, med
    elif result == "sparse_attention_smoke.json":
        (case,) = json.loads((tmp_path / result).read_text())["cases"]
        assert case["results"]["sparse"]["median_s"] > 0 and case["sparsity"] == 0.75, case
    elif result == "pipe_partitioned_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        assert min(data["median_step_s"].values()) > 0, data["median_step_s"]
        assert 0.4 < data["byte_ratio"] < 0.6, data["isend_bytes_per_step"]
    elif result == "exit_soak_smoke.json":
        data = json.loads((tmp_path / result).read_text())
        assert data["total_jobs"] == 2 and data["clean_jobs"] == 2, data["configs"]
    elif result:
        data = json.loads((tmp_path / result).read_text())
        for case in ("fp32", "bf16"):
            medians = data["cases"][case]["median_step_s"]
            assert medians["ours DeepSpeedCPUAdam"] > 0, medians
            assert len(medians) >= 3, medians  # ours and the two torch peers

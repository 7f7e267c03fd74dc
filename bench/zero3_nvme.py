"""Benchmark: ZeRO-3 NVMe offload against CPU offload, ours only (2 CPU ranks, fp32).

Workload and jobs as bench/zero3_step.py (the 48M GPT, micro-batch 1 per rank, AdamW), all
on its partitioned config (every parameter released after use, one block of gathers
prefetched), so that parameter shards are read back during the step:
  cpu offload            offload_param + offload_optimizer {device: cpu}
  nvme                   both {device: nvme} under a fresh directory of this machine's disk
                         (max_in_cpu 0: every shard on disk), everything else at its
                         default: offload_param's 5 buffers read shards ahead of their
                         gathers, and each optimizer sub-group (an eighth of a rank's
                         masters) steps in the next forward, just before its layers gather
                         ([Note: optimizer steps in forward]), its reads and writes
                         overlapping that forward
  nvme, no read-ahead    the same with offload_param.buffer_count 0: each shard read when
                         its gather wants it
  nvme, step in          nvme with offload_optimizer.step_in_forward false: engine.step()
    engine.step()        reads, steps and writes every sub-group while nothing else runs
  nvme, pipelined        that with offload_optimizer.pipeline_read/pipeline_write and
    optimizer            sub_group_size 4M: the optimizer's reads and writes overlap steps
  nvme, steps in         nvme with offload_optimizer.step_in_backward and sub_group_size 2M:
    backward             sub-groups step as their gradients complete, so their reads and
                         writes overlap the backward's compute
Every job clips gradients at 1.0 (the default) except the step_in_backward one, which needs
gradient_clipping 0 (its updates must not wait for the global norm).
Goal (issue): the NVMe step within 1.3x of the CPU-offload step; the read-ahead's gain is
the 'overlap' (no read-ahead step time over the read-ahead one). Contenders alternate over
--rounds rounds; medians. Every job first runs 3 untimed steps (--warmup; WARMUP below says
why), not 1 as in bench/zero3_step.py.

    python bench/zero3_nvme.py            # -> bench/results/zero3_nvme.json (~5 min)
    python bench/zero3_nvme.py --smoke    # tiny model, one round
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import zero3_step as z3
import zero_step as zs
from common import busy_warning, machine_info, print_table
from ddp_step import finish, reap, run_rounds

TARGET = 1.3  # NVMe step time over the CPU-offload step time, at most
# Untimed steps per job: an NVMe job reaches its steady step at its fourth, after the first
# writes of the optimizer-state files (the first update, in the second step's forward) and
# their first reads back (the third's). Timed by phase on rank 0 (2026-11-27): 1.28 and 1.25
# s for steps 2-3, then 1.05-1.11 s; CPU offload 0.94-1.01 s from step 2 on.
WARMUP = 3
IN_STEP = "nvme, step in engine.step()"
BACKWARD = "nvme, steps in backward"


def configs(nvme_dir: str, smoke: bool = False) -> dict[str, dict[str, Any]]:
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    in_step = {**nvme, "step_in_forward": False}
    return {
        "cpu offload": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "nvme": {"offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme},
        "nvme, no read-ahead": {
            "offload_param": {**nvme, "max_in_cpu": 0, "buffer_count": 0},
            "offload_optimizer": nvme,
        },
        IN_STEP: {"offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": in_step},
        # [Note: pipelined optimizer swap]: sub-groups of 4M masters (about 6 a rank), each
        # read while the one before steps and written while the one after steps
        "nvme, pipelined optimizer": {
            "offload_param": {**nvme, "max_in_cpu": 0},
            "offload_optimizer": {**in_step, "pipeline_read": True, "pipeline_write": True},
            "sub_group_size": 4_000_000,
        },
        # [Note: optimizer steps in backward]: about 12 sub-groups a rank (the smoke
        # model's masters are about 50K a rank)
        BACKWARD: {
            "offload_param": {**nvme, "max_in_cpu": 0},
            "offload_optimizer": {**nvme, "step_in_backward": True},
            "sub_group_size": 10_000 if smoke else 2_000_000,
        },
    }


class NvmeContender(z3.Zero3Contender):
    def worker_args(self) -> list[str]:
        clip = "0" if self.name.endswith(BACKWARD) else "1.0"
        return [*super().worker_args(), "--gradient-clipping", clip]


def main() -> int:
    args = z3.parse_args(__doc__, warmup=WARMUP)
    warning = busy_warning()
    t0 = time.perf_counter()
    run_id = f"zero3nvme-{uuid.uuid4().hex[:12]}"
    nvme_dir = tempfile.mkdtemp(prefix="ds_bench_nvme_")
    contenders: dict[str, z3.Zero3Contender] = {}
    for name, extra in configs(nvme_dir, args.smoke).items():
        z3.CONFIGS[name] = ({**z3.PARTITIONED, **extra}, False)
        c = NvmeContender("ours", name, args, run_id)
        contenders[c.name] = c
    try:
        run_rounds(contenders, args.rounds, dict, t0)
    finally:
        leftover = reap(run_id)
        shutil.rmtree(nvme_dir, ignore_errors=True)
    per = zs.summarize(contenders, args)["contenders"]
    step = {n: 1.0 / e["median_steps_per_s"] for n, e in per.items() if "median_steps_per_s" in e}
    ratios = {}
    names = (
        "cpu offload",
        "nvme",
        "nvme, no read-ahead",
        IN_STEP,
        "nvme, pipelined optimizer",
        BACKWARD,
    )
    cpu, nv, cold, in_step, piped, early = (step.get(f"ours {k}") for k in names)
    if cpu and nv:
        ratios["nvme_over_cpu_offload_step_time"] = nv / cpu
    if cpu and in_step:
        ratios["in_step_nvme_over_cpu_offload_step_time"] = in_step / cpu
    if cpu and piped:
        ratios["pipelined_nvme_over_cpu_offload_step_time"] = piped / cpu
    if cpu and early:
        ratios["steps_in_backward_nvme_over_cpu_offload_step_time"] = early / cpu
    if nv and cold:
        ratios["no_read_ahead_over_read_ahead_step_time"] = cold / nv
    print(f"\n== zero3_nvme: {args.ranks} CPU ranks, medians over {args.rounds} rounds ==")
    rows = [
        [n, f"{step[n] * 1000:.0f}" if n in step else "failed", len(per[n].get("jobs", []))]
        for n in per
    ]
    print_table(["contender", "step ms", "jobs"], rows)
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}")
    for key in (
        "nvme_over_cpu_offload_step_time",
        "in_step_nvme_over_cpu_offload_step_time",
        "pipelined_nvme_over_cpu_offload_step_time",
        "steps_in_backward_nvme_over_cpu_offload_step_time",
    ):
        if key in ratios:
            verdict = "met" if ratios[key] <= TARGET else "NOT met"
            print(f"  target ({key}): NVMe step <= {TARGET}x CPU offload's: {verdict}")
    payload = {
        "benchmark": "zero3_nvme",
        "workload": {
            "model": args.model,
            "configs": {
                k: v[0] for k, v in z3.CONFIGS.items() if k in configs(nvme_dir, args.smoke)
            },
            "ranks": args.ranks,
            "rounds": args.rounds,
            "steps_per_job": args.steps,
            "warmup_per_job": args.warmup,
            "nvme_dir_filesystem": shutil.disk_usage(str(Path(nvme_dir).parent))._asdict(),
        },
        "machine": machine_info("cpu"),
        "target_nvme_over_cpu_step_time": TARGET,
        "contenders": per,
        "step_s": step,
        "ratios": ratios,
        "busy_warning": warning,
        "leftover_pids_killed_at_end": leftover,
        "wall_s": time.perf_counter() - t0,
    }
    return finish("zero3_nvme", payload, contenders, args.smoke)


if __name__ == "__main__":
    sys.exit(main())

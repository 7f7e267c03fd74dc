"""Soak: N back-to-back 2-rank jobs through our `deepspeed` launcher for each ZeRO stage and
offload mode, counting exit codes. A job that did its work must exit 0 every time
([Note: clean exit] in deepspeed_ext/comm/init.py); a non-zero exit is recorded with the
tail of its output. Not a speed benchmark: it counts.

    python bench/exit_soak.py --jobs 25   # 8 configs x 25 jobs -> bench/results/exit_soak.json
    python bench/exit_soak.py --smoke     # 1 job of 2 configs
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import machine_info, print_table, write_result

WORKER = Path(__file__).resolve().parent / "peers" / "exit_worker.py"
CONFIGS = [(s, off) for s in (0, 1, 2, 3) for off in (False, True)]


def run_job(stage: int, offload: bool, timeout: float) -> tuple[int, str]:
    launcher = shutil.which("deepspeed") or "deepspeed"
    cmd = [launcher, "--num_gpus", "2", "--master_port", "0", str(WORKER), "--stage", str(stage)]
    if offload:
        cmd.append("--offload")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout} s: {str(exc.stdout)[-500:]}"
    done = "EXIT_WORKER_DONE" in r.stdout + r.stderr
    tail = (r.stdout + r.stderr)[-800:]
    return r.returncode, ("" if r.returncode == 0 else f"work done: {done}; " + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=25, help="jobs per config")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--job-timeout", type=float, default=180)
    args = ap.parse_args()
    configs = CONFIGS[:2] if args.smoke else CONFIGS
    jobs = 1 if args.smoke else args.jobs
    t0 = time.perf_counter()
    results = {}
    rows = []
    for stage, offload in configs:
        name = f"stage {stage}" + (" + offload" if offload else "")
        codes, failures = [], []
        for _ in range(jobs):
            rc, detail = run_job(stage, offload, args.job_timeout)
            codes.append(rc)
            if rc != 0:
                failures.append({"exit_code": rc, "detail": detail})
        clean = sum(c == 0 for c in codes)
        results[name] = {"jobs": jobs, "clean": clean, "exit_codes": codes, "failures": failures}
        rows.append([name, jobs, clean, jobs - clean, sorted(set(codes))])
        print(f"  {name}: {clean}/{jobs} clean", flush=True)
    print_table(["config", "jobs", "exit 0", "failed", "exit codes"], rows)
    total = sum(r["jobs"] for r in results.values())
    clean = sum(r["clean"] for r in results.values())
    print(f"\n{clean}/{total} jobs exited 0")
    path = write_result(
        "exit_soak",
        {
            "benchmark": "exit_soak",
            "workload": "2-rank launcher job, 4 x Linear(256), 5 AdamW steps, normal return",
            "machine": machine_info(),
            "configs": results,
            "total_jobs": total,
            "clean_jobs": clean,
            "wall_s": time.perf_counter() - t0,
        },
        smoke=args.smoke,
    )
    print(f"wrote {path}")
    return 0 if clean == total else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: cold JIT build and warm load of the cpu_adam op, each in a fresh process.

  cold   a new process with an empty temporary DS_EXT_CACHE_DIR: CPUAdamBuilder().load()
         compiles the op (ninja + the C++ compiler) and loads it
  warm   a new process with the same cache: load() finds the stamped library and loads it
  floor  a new process that only calls torch.ops.load_library() on that same library: the
         least a warm load can cost (the physical limit of this benchmark)
  peer   upstream deepspeed==0.19.8 CPUAdamBuilder().load() in its own venv, warm (its
         torch_extensions build already there; primed once, untimed), as upstream's
         DeepSpeedCPUAdam calls it

Each child times, with perf_counter inside itself, `import torch`, the import of the op
builder and the load() call; the parent also times the whole process (start to exit).
Warm, floor and peer processes alternate (order reversed every other repetition); medians.
Target (issue): warm load() < 0.5 s.

    python bench/op_build.py            # writes bench/results/op_build.json
    python bench/op_build.py --smoke    # 1 warm repetition, writes op_build_smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import (
    busy_warning,
    machine_info,
    median,
    print_table,
    upstream_python,
    write_result,
)

TARGET_WARM_LOAD_S = 0.5
MARK = "BENCH_JSON "

OURS_CHILD = f"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from deepspeed_ext.op_builder import CPUAdamBuilder
t2 = time.perf_counter()
b = CPUAdamBuilder()
op = b.load()
t3 = time.perf_counter()
lib = b.prebuilt_path() or b.cached_path()
print({MARK!r} + json.dumps({{"import_torch_s": t1 - t0, "import_builder_s": t2 - t1,
      "load_s": t3 - t2, "lib": str(lib), "prebuilt": b.prebuilt_path() is not None,
      "simd": op.simd_level()}}))
"""

FLOOR_CHILD = f"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.ops.load_library(sys.argv[1])
t2 = time.perf_counter()
print({MARK!r} + json.dumps({{"import_torch_s": t1 - t0, "import_builder_s": 0.0,
      "load_s": t2 - t1}}))
"""

UPSTREAM_CHILD = f"""
import json, os, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from deepspeed.ops.op_builder import CPUAdamBuilder
import deepspeed
t2 = time.perf_counter()
CPUAdamBuilder().load()
t3 = time.perf_counter()
assert deepspeed.__file__.startswith(sys.prefix), deepspeed.__file__
print({MARK!r} + json.dumps({{"import_torch_s": t1 - t0, "import_builder_s": t2 - t1,
      "load_s": t3 - t2, "peer": "deepspeed==" + deepspeed.__version__}}))
"""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="1 warm repetition")
    ap.add_argument("--reps", type=int, default=5, help="warm repetitions (each kind)")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream peer")
    args = ap.parse_args()
    if args.smoke:
        args.reps = 1
    if args.reps < 1:
        ap.error("need reps >= 1")
    return args


def run_child(
    cmd: list[str], env: dict[str, str], cwd: str, timeout: float = 900
) -> dict[str, Any]:
    """Run one child; its measurement plus the process wall time, or raise RuntimeError."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(str(e)) from None
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise RuntimeError(f"exit {proc.returncode}: {tail}")
    out: dict[str, Any] = json.loads(lines[-1][len(MARK) :])
    out["process_wall_s"] = wall
    out["built"] = "building op" in proc.stderr
    return out


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    upy = upstream_python()
    skipped: str | None = None
    if args.no_upstream:
        skipped = "--no-upstream"
    elif not upy.exists():
        skipped = (
            f"no upstream venv at {upy.parent.parent}; run bench/peers/setup_upstream.sh "
            "(or set DS_UPSTREAM_VENV)"
        )

    with tempfile.TemporaryDirectory(prefix="ds_op_build_") as tmp:
        cache = os.path.join(tmp, "cache")  # made 0700 by the builder
        cwd = os.path.join(tmp, "cwd")  # outside the repo: the installed package is loaded
        os.mkdir(cwd)
        env = {**base_env, "DS_EXT_CACHE_DIR": cache}
        ours_cmd = [sys.executable, "-c", OURS_CHILD]
        print("cold build (empty cache) ...", file=sys.stderr)
        cold = run_child(ours_cmd, env, cwd)
        floor_cmd = [sys.executable, "-c", FLOOR_CHILD, cold["lib"]]
        up_cmd = [str(upy), "-I", "-c", UPSTREAM_CHILD]
        if skipped is None:
            try:  # primes upstream's torch_extensions build (compiles only if missing)
                run_child(up_cmd, base_env, cwd)
            except RuntimeError as e:
                skipped = f"upstream peer failed: {e}"
        kinds = {"warm": ours_cmd, "floor": floor_cmd}
        if skipped is None:
            kinds["upstream warm"] = up_cmd
        raw: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        names = list(kinds)
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                try:
                    raw[name].append(
                        run_child(kinds[name], env if name != "upstream warm" else base_env, cwd)
                    )
                except RuntimeError as e:
                    if name != "upstream warm":
                        raise
                    skipped = f"upstream peer failed: {e}"
                    names.remove(name)
                    del raw[name]
            print(f"warm repetition {rep + 1}/{args.reps} done", file=sys.stderr)

    fields = ("load_s", "process_wall_s", "import_torch_s", "import_builder_s")
    medians = {k: {f: median([r[f] for r in runs]) for f in fields} for k, runs in raw.items()}
    medians = {"cold": {f: cold[f] for f in fields}, **medians}
    warm_load = medians["warm"]["load_s"]
    ratios = {
        "upstream_warm_load_over_ours": (
            medians["upstream warm"]["load_s"] / warm_load if "upstream warm" in medians else None
        ),
        "ours_warm_load_over_floor": warm_load / medians["floor"]["load_s"],
    }

    print(
        f"cpu_adam op ({cold['simd']}{', prebuilt library installed' if cold['prebuilt'] else ''}),"
        f" fresh process each; warm: median of {args.reps}"
    )
    rows = [
        [
            k,
            f"{m['load_s'] * 1e3:.1f}",
            f"{m['import_builder_s'] * 1e3:.1f}",
            f"{m['import_torch_s'] * 1e3:.0f}",
            f"{m['process_wall_s']:.2f}",
        ]
        for k, m in medians.items()
    ]
    print_table(["process", "load() ms", "import builder ms", "import torch ms", "wall s"], rows)
    if cold["prebuilt"] or not cold["built"]:
        print("note: the cold process did not compile (a prebuilt library is installed)")
    if skipped:
        print(f"upstream: skipped ({skipped})")
    up = ratios["upstream_warm_load_over_ours"]
    if up is not None:
        print(f"upstream warm load() / ours: {up:.1f}x")
    print(f"ours warm load() / bare load_library: {ratios['ours_warm_load_over_floor']:.2f}x")
    verdict = "met" if warm_load < TARGET_WARM_LOAD_S else "NOT met"
    print(
        f"target (issue): warm load() < {TARGET_WARM_LOAD_S} s   got {warm_load:.3f} s  {verdict}"
    )

    wall = time.perf_counter() - t_start
    payload = {
        "benchmark": "op_build",
        "workload": {
            "op": "cpu_adam",
            "warm_reps": args.reps,
            "smoke": args.smoke,
            "upstream_cmd": [str(upy), "-I", "-c", "<UPSTREAM_CHILD>"],
        },
        "machine": machine_info("cpu"),
        "target": {"warm_load_s_below": TARGET_WARM_LOAD_S},
        "cold": cold,
        "raw": raw,
        "median": medians,
        "ratios": ratios,
        "upstream_skipped": skipped,
        "busy_warning": warning,
        "wall_s": wall,
    }
    path = write_result("op_build", payload, smoke=args.smoke)
    if warning:
        print(warning)
    print(f"wrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: activation checkpointing's memory cut and step-time overhead on a 12-layer GPT
(examples/gpt.py: d_model 128, 8 heads, seq 128, batch 8, vocab 256; 1 thread), per block
("full"), per two blocks ("every-2"), non-reentrant, and on 3 of every 4 blocks ("3-of-4",
Megatron's block method: less recompute for less memory cut), for this project's
deepspeed.checkpointing, torch.utils.checkpoint, and upstream DeepSpeed 0.19.8's
deepspeed.checkpointing (its own venv, bench/peers/setup_upstream.sh).

Each implementation runs in its own process (bench/peers/ac_worker.py), alternating its
variants in rounds; the processes alternate too. Figures per variant against the same
process's run without checkpointing: memory held for the backward at the end of the forward
(resident set growth over the forward, with glibc's mmap threshold fixed so freed tensors
leave it: the same yardstick for every implementation; autograd's saved-tensor bytes are
recorded too, but upstream keeps its checkpoint inputs outside them), peak resident memory
over a step above the memory before it, and the step (forward + backward) time, median.
Goal (the issue): >= 60% activation memory cut at <= 30% step overhead, no worse than torch.
cpu_checkpointing is not a variant here: on a CPU device the host is the device, so it
keeps the same tensors (it moves them only off an accelerator).

    python bench/activation_checkpointing.py          # -> bench/results/<name>.json
    python bench/activation_checkpointing.py --smoke    # 4 layers, one round, ours only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import busy_warning, machine_info, median, print_table, write_result

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "peers" / "ac_worker.py"
UPSTREAM_PY = (
    Path(os.environ.get("DS_UPSTREAM_VENV", Path.home() / ".cache/deepspeed_ext/upstream-venv"))
    / "bin"
    / "python"
)
MEMORY_CUT, OVERHEAD = 0.60, 0.30


def run_worker(impl: str, extra: list[str]) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    if impl == "upstream":
        env.pop("PYTHONPATH", None)
        env["DS_ACCELERATOR"] = "cpu"
        cmd = [str(UPSTREAM_PY), "-P", str(WORKER), "--impl", impl, *extra]
        cwd = "/tmp"  # never this repository: it is a package named deepspeed too
    else:
        cmd = [sys.executable, str(WORKER), "--impl", impl, *extra]
        cwd = str(ROOT)
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    for line in r.stdout.splitlines():
        if line.startswith("AC_RESULT "):
            return json.loads(line[len("AC_RESULT ") :])
    raise RuntimeError(f"{impl} worker failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="process rounds (each alternates)")
    ap.add_argument("--no-upstream", action="store_true")
    args = ap.parse_args()
    warning = busy_warning()
    t0 = time.perf_counter()
    extra = ["--layers", "4", "--rounds", "1", "--steps", "1"] if args.smoke else []
    impls = ["ours"]
    upstream = not (args.smoke or args.no_upstream) and UPSTREAM_PY.exists()
    if upstream:
        impls.append("upstream")
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    for r in range(1 if args.smoke else args.rounds):
        for impl in impls if r % 2 == 0 else list(reversed(impls)):
            runs[impl].append(run_worker(impl, extra))

    rows, table = [], []
    for impl, results in runs.items():
        for name in results[0]["step_s"]:
            step = median([x["step_s"][name] for x in results])
            base = median([x["step_s"]["none"] for x in results])
            saved = median([x["held_bytes"][name] for x in results])
            saved0 = median([x["held_bytes"]["none"] for x in results])
            hooked = results[0]["saved_bytes"][name]
            peak = median([x["peak_bytes"][name] for x in results])
            peak0 = median([x["peak_bytes"]["none"] for x in results])
            row = {
                "impl": impl,
                "variant": name,
                "activation_mb": saved / 2**20,
                "autograd_saved_mb": hooked / 2**20,
                "activation_cut": 1 - saved / saved0,
                "peak_mb": peak / 2**20,
                "peak_cut": 1 - peak / peak0 if peak0 else None,
                "step_s": step,
                "overhead": step / base - 1,
            }
            rows.append(row)
            label = f"{impl}: {name}" if name != "none" else f"{impl}: none (baseline)"
            table.append(
                [
                    label,
                    f"{row['activation_mb']:.1f}",
                    f"{100 * row['activation_cut']:.0f}%",
                    f"{row['peak_mb']:.1f}",
                    f"{100 * row['peak_cut']:.0f}%" if row["peak_cut"] is not None else "-",
                    f"{1000 * step:.0f}",
                    f"{100 * row['overhead']:+.0f}%",
                ]
            )
    print_table(
        ["variant", "act MB", "act cut", "peak MB", "peak cut", "step ms", "overhead"], table
    )
    ours = {r["variant"]: r for r in rows if r["impl"] == "ours"}
    up = {r["variant"]: r for r in rows if r["impl"] == "upstream"}
    # each of ours against torch's and upstream's same way of checkpointing
    peers = {
        "ours full": ("torch reentrant", "upstream full"),
        "ours non-reentrant": ("torch full", "upstream non-reentrant"),
        "ours 3-of-4": ("torch 3-of-4 reentrant", "upstream 3-of-4"),
        "ours 3-of-4 non-reentrant": ("torch 3-of-4", None),
    }
    verdict: dict[str, Any] = {}
    for name, (torch_peer, up_peer) in peers.items():
        r = ours.get(name)
        if r is None:
            continue
        v: dict[str, Any] = {
            "memory_cut_met": r["activation_cut"] >= MEMORY_CUT,
            "overhead_met": r["overhead"] <= OVERHEAD,
            "vs_torch_memory": r["activation_mb"] / ours[torch_peer]["activation_mb"],
            "vs_torch_overhead_points": 100 * (r["overhead"] - ours[torch_peer]["overhead"]),
        }
        if up_peer and up_peer in up:
            v["vs_upstream_memory"] = r["activation_mb"] / up[up_peer]["activation_mb"]
            v["vs_upstream_step"] = r["step_s"] / up[up_peer]["step_s"]
        verdict[name] = v
        shown = (f"{k} {x:.3f}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items())
        print(f"{name}: " + ", ".join(shown))
    if not upstream and not args.smoke:
        print("upstream not run: create its venv with bash bench/peers/setup_upstream.sh")
    payload = {
        "workload": "examples/gpt.py GPT, 12 layers (smoke: 4), d_model 128, 8 heads, seq 128, "
        "batch 8, vocab 256, fp32, 1 thread, forward + backward",
        "machine": machine_info(),
        "goal": {"activation_cut": MEMORY_CUT, "overhead": OVERHEAD},
        "rows": rows,
        "verdict": verdict,
        "raw": runs,
        "upstream_run": upstream,
        "busy_warning": warning,
        "wall_s": time.perf_counter() - t0,
    }
    path = write_result("activation_checkpointing", payload, smoke=args.smoke)
    if warning:
        print(warning)
    print(f"\nwrote {path} ({payload['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: AutoTP training (tensor_parallel.autotp_size 2) against data parallelism on 2
CPU ranks, ours and upstream DeepSpeed 0.19.8 (its venv, bench/peers/setup_upstream.sh, with
transformers added), on a Hugging Face Llama built from a config: 12 layers, hidden 512,
8 heads (4 key/value heads), MLP 1536, vocab 8192, untied lm_head (46M params); micro-batch
4 x 128 tokens per data-parallel rank, ZeRO 1, torch AdamW as the client optimizer, fp32.

Each contender is a 2-rank job of bench/peers/tp_step_worker.py under torch.distributed.run
(upstream's from a temp cwd with its venv's python, DS_ACCELERATOR=cpu); contenders alternate
over --rounds rounds, medians over rounds. Per contender: step time (rank 0, between
barriers), per-rank steady peak resident memory (VmHWM after the warmup), and the parameter
bytes each rank holds against the formula of ours: sliced weights (q, k, v, o, gate, up,
down, lm_head, the embedding) / tp + replicated (norms), fp32.
Goal (the issue): ours at TP 2 >= 1.2x upstream's TP 2 step rate at <= its memory; held
parameter bytes within 10% of the formula.

    python bench/tp_step.py                # -> bench/results/tp_step.json
    python bench/tp_step.py --smoke        # a tiny Llama, one round, ours only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import busy_warning, machine_info, median, print_table, upstream_python, write_result

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "peers" / "tp_step_worker.py"
TAG = "TP_STEP_RESULT "
FULL = {"layers": 12, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1536, "vocab": 8192,
        "seq": 128, "micro_batch": 4, "steps": 6, "warmup": 2}  # fmt: skip
SMOKE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
         "seq": 32, "micro_batch": 2, "steps": 2, "warmup": 1}  # fmt: skip


def formula_mb(m: dict[str, int], tp: int) -> float:
    h, kv = m["hidden"], m["kv_heads"] * (m["hidden"] // m["heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * m["ffn"]
    # lm_head and the embedding are cut too (the model's tp_plan: colwise_gather_output,
    # embedding_rowwise); the norms stay whole
    sliced = m["layers"] * per_layer + 2 * m["vocab"] * h
    replicated = (2 * m["layers"] + 1) * h
    return 4 * (sliced / tp + replicated) / 2**20


def job(impl: str, tp: int, m: dict[str, int]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in m.items()]
    run = ["-m", "torch.distributed.run", "--nproc_per_node", "2", str(WORKER)]
    run += ["--impl", impl, "--tp", str(tp), *flags]
    if impl == "upstream":
        env.pop("PYTHONPATH", None)
        env["DS_ACCELERATOR"] = "cpu"
        cmd, cwd = (
            [str(upstream_python()), "-P", *run],
            "/tmp",
        )  # never this repo: it is `deepspeed`
    else:
        cmd, cwd = [sys.executable, *run], str(ROOT)
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1200)
    for line in r.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"{impl} tp {tp} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-upstream", action="store_true")
    args = ap.parse_args()
    m = SMOKE if args.smoke else FULL
    rounds = 1 if args.smoke else args.rounds
    impls = ["ours"] if args.smoke or args.no_upstream or not upstream_python().exists() else [
        "ours", "upstream"]  # fmt: skip
    contenders = [(impl, tp) for impl in impls for tp in (2, 1)]
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    results: dict[str, list[dict[str, Any]]] = {f"{i} tp{t}": [] for i, t in contenders}
    failures: dict[str, str] = {}
    for r in range(rounds):
        for impl, tp in contenders if r % 2 == 0 else contenders[::-1]:
            name = f"{impl} tp{tp}"
            if name in failures:
                continue
            try:
                results[name].append(job(impl, tp, m))
            except RuntimeError as e:
                failures[name] = str(e)[-2000:]
                print(f"  {name}: {failures[name][-600:]}", file=sys.stderr)
    summary: dict[str, Any] = {}
    for name, rs in results.items():
        if not rs:
            continue
        tp = rs[0]["tp"]
        summary[name] = {
            "step_s": median([x["step_s"] for x in rs]),
            "steady_peak_mb": median([max(k["peak_mb"] for k in x["ranks"]) for x in rs]),
            "peak_above_base_mb": median(
                [max(k["peak_mb"] - k["base_mb"] for k in x["ranks"]) for x in rs]
            ),
            "held_mb": rs[0]["ranks"][0]["held_mb"],
            "formula_held_mb": formula_mb(m, tp),
            "params": rs[0]["params"],
            "final_loss": rs[-1]["final_loss"],
            "deepspeed": rs[0]["deepspeed"],
        }
    ratios: dict[str, Any] = {}
    ours, theirs = summary.get("ours tp2"), summary.get("upstream tp2")
    if ours and theirs:
        ratios["ours/upstream step rate (tp2)"] = theirs["step_s"] / ours["step_s"]
        ratios["ours/upstream steady peak (tp2)"] = (
            ours["steady_peak_mb"] / theirs["steady_peak_mb"]
        )
    if ours and summary.get("ours tp1"):
        ratios["ours tp2/tp1 step rate"] = summary["ours tp1"]["step_s"] / ours["step_s"]
    for name, s in summary.items():
        ratios[f"{name} held/formula"] = s["held_mb"] / s["formula_held_mb"]
    print_table(
        ["contender", "step s", "steady peak MB", "peak-base MB", "held MB", "formula MB"],
        [[n, s["step_s"], s["steady_peak_mb"], s["peak_above_base_mb"], s["held_mb"],
          s["formula_held_mb"]] for n, s in summary.items()],
    )  # fmt: skip
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    payload = {
        "bench": "tp_step",
        "machine": machine_info(),
        "model": m,
        "rounds": rounds,
        "busy_warning": warning,
        "summary": summary,
        "ratios": ratios,
        "failures": failures,
        "runs": results,
    }
    path = write_result("tp_step", payload, smoke=args.smoke)
    print(f"wrote {path}")
    return 1 if failures and args.smoke else 0  # a full run records a failing peer


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: pipeline-parallel training steps/s of our 1F1B PipelineEngine against upstream
DeepSpeed 0.19.8's PipelineEngine and torch.distributed.pipelining's Schedule1F1B, 4 CPU
ranks = 4 stages, and the measured pipeline bubble against (p-1)/(m+p-1).

Workloads (bench/peers/pipeline_step_worker.py, one 4-rank job per contender per round):
  real      a GPT of 10 blocks, d_model 384, 6 heads, seq 32, vocab 8192 (24.0M params),
            embeddings as layer 0, norm + untied head as the last, cut by layer count into
            4 stages; micro-batch 1; fp32; AdamW lr 1e-3 (ours: our CPU AdamW from the
            config; upstream: its optimizer for the config's AdamW; torch: torch.optim.AdamW)
  emulated  each stage one layer that sleeps F = 20 ms forward, B = 20 ms for the input
            gradient and W = 20 ms for the weight gradient: fixed-time compute that does not
            compete for the 2 cores, so the bubble is the schedule's: 1 - m*(F+B+W)/step_time
            with F+B+W as the worker times one micro-batch of its layer (sleeps overshoot:
            ~61.7 ms, not 60; the optimizer step on 768 params is ~0); ours also zero
            bubble (ZB-H1: B and W in passes of their own), whose idle time (the step time
            less m*(F+B+W)) is compared with ours 1F1B's (theory: a third);
            ours also interleaved: 2 chunks per rank of F/2 and B/2 each (the same work per
            rank), against (p-1)/(v*m+p-1)
and DualPipeV (m >= 2p: m = 8, 16), ours and upstream's, both workloads: 2 stages per rank
as a V, each of half a rank's work; its idle time is compared with the same impl's 1F1B
(the schedule model in tests/unit/runtime/pipe/test_schedule.py: 11 units against 18 at
p = 4, F = 1 and B = 2 per half-stage); and ours dualpipev-zb (emulated: each backward
split, its W right after the input gradients are sent; the model's 6 units)
for m in {4, 8, 16} micro-batches per step. Every rank OMP_NUM_THREADS=1 (4 ranks share 2
cores in the real workload: its absolute times say little, its ratios compare schedules and
engines under the same contention). Contenders alternate over --rounds rounds; each job's
step time is its median step (of --steps), and a contender's the median over its rounds.

    python bench/pipeline_step.py            # full run -> bench/results/pipeline_step.json
    python bench/pipeline_step.py --smoke    # emulated m=4 (and DualPipeV m=8), one round,
                                             # no upstream
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from common import busy_warning, machine_info, median, print_table
from ddp_step import Contender, finish, reap, run_rounds

WORKER = Path(__file__).resolve().parent / "peers" / "pipeline_step_worker.py"
STAGES = 4
F_MS = 20.0
TARGETS = {
    "vs_upstream": 1.2,
    "vs_torch": 1.0,
    "bubble_within": 0.10,
    "zb_h1_idle_vs_1f1b": 0.4,
}


class PipeContender(Contender):
    worker = WORKER
    result_tag = "PIPELINE_STEP_RESULT "
    torchrun_impls = ("torch",)

    def __init__(
        self,
        impl: str,
        mode: str,
        m: int,
        args: Any,
        run_id: str,
        chunks: int = 1,
        schedule: str = "1f1b",
    ) -> None:
        super().__init__(impl, f"{mode} m={m}", args, run_id)
        self.mode, self.m, self.chunks, self.schedule = mode, m, chunks, schedule
        if schedule != "1f1b":
            self.name = f"{impl} {schedule} {mode} m={m}"
        elif chunks > 1:
            self.name = f"{impl} interleaved v={chunks} {mode} m={m}"

    def worker_args(self) -> list[str]:
        a = self.args
        return [
            str(self.worker),
            *("--impl", self.impl, "--mode", self.mode, "--micro-batches", str(self.m)),
            *("--steps", str(a.steps), "--warmup", str(a.warmup), "--run-id", self.run_id),
            *("--emulate-ms", str(F_MS), "--chunks", str(self.chunks)),
            *("--schedule", self.schedule),
        ]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--job-timeout", type=float, default=300.0)
    ap.add_argument(
        "--only-interleaved", action="store_true", help="only ours interleaved (emulated)"
    )
    args = ap.parse_args()
    args.ranks = STAGES
    args.modes = ("real", "emulated")
    args.ms = (4, 8, 16)
    if args.only_interleaved:
        args.modes = ("emulated",)
    if args.smoke:
        args.rounds, args.steps, args.modes, args.ms = 1, 2, ("emulated",), (4,)
        args.no_upstream = True
    return args


def bubble_formula(m: int, p: int = STAGES, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def summarize(contenders: dict[str, PipeContender]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for name, c in contenders.items():
        e: dict[str, Any] = {"impl": c.impl, "mode": c.mode, "m": c.m, "chunks": c.chunks}
        e["schedule"] = c.schedule
        e["skipped"] = c.skipped
        e |= {"jobs": c.jobs, "raw": c.results}
        e["step_s_per_round"] = [r["step_s"] for r in c.results]
        if c.results and not c.skipped:
            e["median_step_s"] = median(e["step_s_per_round"])
            if c.mode == "emulated":
                # the emulated compute as timed by the worker (F + B + W of ~60 ms each
                # micro-batch, a little more: sleeps overshoot)
                per_mb = [r.get("compute_ms_per_micro_batch") or 3 * F_MS for r in c.results]
                e["compute_ms_per_micro_batch"] = median(per_mb)
                ideal = c.m * e["compute_ms_per_micro_batch"] / 1000.0
                e["bubble"] = 1.0 - ideal / e["median_step_s"]
                e["idle_s"] = e["median_step_s"] - ideal
                v = c.schedule.startswith("dualpipev")  # no closed formula: idle vs 1F1B's
                e["bubble_formula"] = None if v else bubble_formula(c.m, STAGES, c.chunks)
        per[name] = e
    ratios: dict[str, Any] = {}
    for name, e in per.items():
        if e["schedule"] != "1f1b" and "idle_s" in e:  # against the same impl's 1F1B
            base = per.get(f"{e['impl']} {e['mode']} m={e['m']}", {})
            if "idle_s" in base:
                e["idle_vs_1f1b"] = e["idle_s"] / base["idle_s"]
        if e["schedule"].startswith("dualpipev") and "median_step_s" in e:
            peer = per.get(name.replace("ours", "upstream", 1), {})
            if e["schedule"] == "dualpipev" and e["impl"] == "ours" and "median_step_s" in peer:
                ratios[f"{e['mode']} m={e['m']} dualpipev vs upstream"] = (
                    peer["median_step_s"] / e["median_step_s"]
                )
            continue
        if e["impl"] != "ours" or "median_step_s" not in e or e["chunks"] > 1:
            continue
        if e["schedule"] != "1f1b":  # ZB-H1's step against ours 1F1B's
            base = per.get(f"ours {e['mode']} m={e['m']}", {})
            if "median_step_s" in base:
                ratios[f"{e['mode']} m={e['m']} zb-h1 vs 1f1b"] = (
                    base["median_step_s"] / e["median_step_s"]
                )
            continue
        for peer in ("upstream", "torch"):
            other = per.get(name.replace("ours", peer, 1), {})
            if "median_step_s" in other:
                ratios[f"{e['mode']} m={e['m']} vs {peer}"] = (
                    other["median_step_s"] / e["median_step_s"]
                )
    return {"contenders": per, "ours_speedup": ratios}


def report(summary: dict[str, Any]) -> None:
    print("\n== pipeline_step: 4 stages x 1 data rank, CPU gloo, medians over rounds ==")
    rows = []
    for name, e in summary["contenders"].items():
        if "median_step_s" not in e:
            rows.append([name, "skipped" if e["skipped"] else "failed", "", "", ""])
            continue
        bub = f"{e['bubble']:.3f}" if "bubble" in e else ""
        if "idle_vs_1f1b" in e:
            bub += f", idle {e['idle_vs_1f1b']:.2f}x 1F1B's"
        elif e.get("bubble_formula") is not None:
            bub += f" ({e['bubble_formula']:.3f})"
        speed = ""
        if e["impl"] == "ours" and e["schedule"] == "dualpipev":
            key = f"{e['mode']} m={e['m']} dualpipev vs upstream"
            if key in summary["ours_speedup"]:
                speed = f"upstream's {summary['ours_speedup'][key]:.2f}x"
        if e["impl"] == "ours" and e["chunks"] == 1 and e["schedule"] == "1f1b":
            r = summary["ours_speedup"]
            key = f"{e['mode']} m={e['m']}"
            speed = " ".join(
                f"{peer} {r[f'{key} vs {peer}']:.2f}x"
                for peer in ("upstream", "torch")
                if f"{key} vs {peer}" in r
            )
        rows.append([name, f"{e['median_step_s'] * 1000:.0f}", bub, speed, len(e["raw"])])
    print_table(["contender", "step ms", "bubble (formula)", "ours faster than", "rounds"], rows)


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    run_id = f"pipeline_step_{uuid.uuid4().hex[:8]}"
    contenders: dict[str, PipeContender] = {}
    for mode in args.modes:
        for m in args.ms:
            for impl in ("ours", "upstream", "torch"):
                if not args.only_interleaved:
                    contenders[f"{impl} {mode} m={m}"] = PipeContender(impl, mode, m, args, run_id)
            if not args.only_interleaved:  # zero bubble: ours only (no peer has it)
                c = PipeContender("ours", mode, m, args, run_id, schedule="zb-h1")
                contenders[c.name] = c
            if mode == "emulated":  # ours only: the peers' interleaved runs are not wired up
                c = PipeContender("ours", mode, m, args, run_id, chunks=2)
                contenders[c.name] = c
            if m >= 2 * STAGES and not args.only_interleaved:  # DualPipeV: ours and upstream's
                for impl in ("ours", "upstream"):
                    c = PipeContender(impl, mode, m, args, run_id, chunks=2, schedule="dualpipev")
                    contenders[c.name] = c
                if mode == "emulated":  # ours split (dualpipev-zb): the bubble it removes
                    c = PipeContender("ours", mode, m, args, run_id, 2, "dualpipev-zb")
                    contenders[c.name] = c
    if args.smoke:  # the DualPipeV worker path too, at its smallest batch
        c = PipeContender("ours", "emulated", 2 * STAGES, args, run_id, 2, "dualpipev")
        contenders[c.name] = c
    busy = busy_warning()
    run_rounds(contenders, args.rounds, dict, t0)
    summary = summarize(contenders)
    report(summary)
    payload = {
        "benchmark": "pipeline_step",
        "targets": TARGETS,
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items()},
        "emulated_forward_ms": F_MS,
        "emulated_backward_ms": 2 * F_MS,  # B + W, F each
        **summary,
        "busy_warning": busy,
        "leftover_pids_killed_at_end": reap(run_id),
        "wall_s": time.perf_counter() - t0,
    }
    name = "pipeline_step_interleaved" if args.only_interleaved else "pipeline_step"
    return finish(name, payload, contenders, args.smoke)


if __name__ == "__main__":
    sys.exit(main())

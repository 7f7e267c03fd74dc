"""Benchmark: ZeRO training steps/s and per-rank peak memory of our engine (stages 0, 1, 2,
2 + CPU optimizer offload) against upstream DeepSpeed 0.19.8 with the same four configs and
torch's ZeroRedundancyOptimizer (the stage-1 peer), 2 CPU ranks, fp32.

Workload: the GPT of examples/gpt.py, 14 layers, d_model 512, 8 heads, seq 128, vocab 8192,
tied embeddings: 48,394,240 params (Psi); micro-batch 1 per rank, 2 ranks (gloo), AdamW
(lr 1e-3, wd 0.01), random token batches from a fixed seed per (rank, step). Each contender
is its own 2-rank job of bench/peers/zero_step_worker.py, one job per contender per round,
launched as bench/ddp_step.py does (ours: our `deepspeed --num_gpus 2`; upstream: its venv's
torch.distributed.run from a temp cwd, no PYTHONPATH, DS_ACCELERATOR=cpu; ZeRO-R: torchrun),
every rank OMP_NUM_THREADS=1. Config of ours and upstream: optimizer AdamW,
zero_optimization {stage: s} (+ offload_optimizer {device: cpu}), everything else default.
  ours      our engine; AdamW -> our DeepSpeedCPUAdam on the fp32 params (stage 0) or on
            fp32 master partitions (stages 1, 2; offload puts them on the CPU: no change here)
  upstream  stage 0: FusedAdam (its CPU JIT op) on the params; stages 1, 2: its ZeRO
            optimizer over FusedAdam, offload over DeepSpeedCPUAdam, fp32 master partitions
  zero_red  torch DDP + ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW): whole
            params assigned to ranks, each steps its own with torch's AdamW, then broadcasts
Rank 0 times --steps steps after --warmup, between barriers; contenders alternate over
--rounds rounds (order reversed every other round); medians over rounds. Memory per rank
(VmHWM of /proc/self/status): 'job' = peak over the whole job (imports, model, initialize,
warmup, timed steps); 'steady' = peak over the timed steps alone (VmHWM reset through
/proc/self/clear_refs after setup + warmup); 'base' = VmRSS after the imports, before the
model. ZeRO model-state bytes per rank for fp32 AdamW (the master is the param itself, so
the paper's K=12 becomes K=8, m and v): stage 0 16Psi, stage 1 (4+4)Psi + 8Psi/N, stage 2
4Psi + (4+8)Psi/N; ours and upstream also keep an fp32 master partition copy in stages 1-2
(+4Psi/N; 'opt MB' shows the optimizer's measured m, v and separate master bytes). Limits
measured here: 1-thread copy bandwidth (Adam floor 28 B/param over the rank's partition)
and 1-thread GEMM at the MLP's shape (model FLOPs per step over it).

    python bench/zero_step.py                        # full run -> bench/results/zero_step.json
    python bench/zero_step.py --smoke --no-upstream  # tiny model, one round of a few steps
    python bench/zero_step.py --ranks 4              # -> bench/results/zero_step_4ranks.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from common import busy_warning, copy_bandwidth, machine_info, median, print_table
from ddp_step import Contender, finish, gemm_gflops, median_limits, reap, run_rounds

WORKER = Path(__file__).resolve().parent / "peers" / "zero_step_worker.py"
MODEL = dict(n_layer=14, d_model=512, n_head=8, seq=128, vocab=8192)
SMOKE_MODEL = dict(n_layer=2, d_model=64, n_head=4, seq=32, vocab=64)
CONFIGS = ((0, False), (1, False), (2, False), (2, True))  # (stage, offload)
TARGET = 1.2  # the issue: ours >= 1.2x upstream steps/s at no more memory, per config
MB = 1 << 20


class ZeroContender(Contender):
    worker = WORKER
    result_tag = "ZERO_STEP_RESULT "
    torchrun_impls = ("zero_redundancy",)

    def __init__(self, impl: str, stage: int, offload: bool, args: Any, run_id: str) -> None:
        super().__init__(impl, config_name(stage, offload), args, run_id)
        self.stage, self.offload = stage, offload
        self.name = "torch ZeRO-R (stage 1)" if impl == "zero_redundancy" else self.name

    def run_round(self) -> None:
        """As Contender.run_round, but a job whose rank 0 printed its result and that then
        exits nonzero (seen here: 'terminate called without an active exception', SIGABRT at
        interpreter exit after ZeRO stage 2, ours and upstream alike) keeps its timing, with
        the exit recorded in job['exit_after_result']; a job without a result is retried once."""
        if self.skipped:
            return
        job, out, err = self._job()
        if self.result_tag not in out:
            first = {**job, "stderr_tail": err.strip()[-1500:]}
            print(f"  {self.name}: job failed (rc {job['rc']}), retrying once", file=sys.stderr)
            job, out, err = self._job()
            job["failed_attempt"] = first
        lines = [ln for ln in out.splitlines() if ln.startswith(self.result_tag)]
        if lines and job["rc"] != 0:
            job["exit_after_result"] = {"rc": job["rc"], "stderr_tail": err.strip()[-600:]}
            print(f"  {self.name}: exited rc {job['rc']} after its result", file=sys.stderr)
        self.jobs.append(job)
        if not lines:
            self.skipped = f"job failed (rc {job['rc']}): {err.strip()[-1500:]}"
            print(f"  {self.name}: {self.skipped}", file=sys.stderr)
            return
        self.results.append(json.loads(lines[-1][len(self.result_tag) :]))

    def worker_args(self) -> list[str]:
        a = self.args
        out = [str(self.worker), "--impl", self.impl, "--stage", str(self.stage)]
        out += ["--steps", str(a.steps), "--warmup", str(a.warmup)]
        out += ["--micro-batch", str(a.micro_batch), "--run-id", self.run_id]
        for key, val in a.model.items():
            out += [f"--{key.replace('_', '-')}", str(val)]
        return out + (["--offload"] if self.offload else [])


def config_name(stage: int, offload: bool) -> str:
    return f"stage {stage}" + (" + offload" if offload else "")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round, few steps")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream peer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per job")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, per job")
    ap.add_argument("--micro-batch", type=int, default=1, help="per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument("--job-timeout", type=float, default=240.0, help="seconds per job")
    args = ap.parse_args()
    args.model = dict(MODEL)
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.model = 1, 2, 1, dict(SMOKE_MODEL)
    if min(args.rounds, args.steps, args.ranks, args.threads) < 1 or args.warmup < 0:
        ap.error("need rounds, steps, ranks, threads >= 1 and warmup >= 0")
    return args


def formula_bytes(psi: int, n: int, stage: int) -> dict[str, float]:
    """fp32 AdamW model states per rank: params 4Psi, grads 4Psi (4Psi/N from stage 2),
    optimizer m + v 8Psi (8Psi/N from stage 1); the master partition copy that stages 1-2
    keep adds 4Psi/N ('with_master_copy')."""
    grads = 4 * psi / n if stage >= 2 else 4 * psi
    opt = 8 * psi / n if stage >= 1 else 8 * psi
    total = 4 * psi + grads + opt
    return {"formula": total, "with_master_copy": total + (4 * psi / n if stage >= 1 else 0)}


def measure_limits(args: argparse.Namespace) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        d, tokens = args.model["d_model"], args.micro_batch * args.model["seq"]
        return {
            "copy_gbps": copy_bandwidth(256 * MB, reps=5).gbps,
            "gemm_gflops_mlp_shape": gemm_gflops(torch.float32, tokens, d, 4 * d),
        }
    finally:
        torch.set_num_threads(threads)


def model_flops(args: argparse.Namespace) -> float:
    m = args.model
    d, L, T, V = m["d_model"], m["n_layer"], m["seq"], m["vocab"]
    tokens = args.micro_batch * T
    return 6.0 * (L * 12 * d * d + V * d) * tokens + 12.0 * L * args.micro_batch * T * T * d


def summarize(contenders: dict[str, ZeroContender], args: argparse.Namespace) -> dict[str, Any]:
    per: dict[str, Any] = {}
    psi = next((c.results[0]["params"] for c in contenders.values() if c.results), 0)
    for name, c in contenders.items():
        e: dict[str, Any] = {"impl": c.impl, "stage": c.stage, "offload": c.offload}
        e |= {"skipped": c.skipped, "jobs": c.jobs, "raw": c.results}
        e["steps_per_s_per_round"] = c.steps_per_s
        e["model_state_bytes_per_rank"] = formula_bytes(psi, args.ranks, c.stage)
        if c.results and len(c.results) == len(c.jobs) and not c.skipped:
            ranks = range(len(c.results[0]["mem"]))

            def mem(key: str, c: ZeroContender = c, ranks: range = ranks) -> list[float]:
                return [median([r["mem"][k][key] * 1024 for r in c.results]) for k in ranks]

            e |= {
                "median_steps_per_s": median(c.steps_per_s),
                "peak_rss_job_bytes": mem("hwm_job_kb"),
                "peak_rss_steady_bytes": mem("hwm_steady_kb"),
                "rss_after_import_bytes": mem("rss_after_import_kb"),
                "optimizer": c.results[0].get("optimizer"),
                "base_optimizer": c.results[0]["mem"][0]["base_optimizer"],
                "opt_state_bytes_rank0": c.results[0]["mem"][0]["state_bytes"],
                "opt_master_bytes_rank0": c.results[0]["mem"][0]["master_bytes"],
                "final_loss": c.results[0].get("final_loss"),
                "threads_per_rank": c.results[0].get("threads"),
            }
        per[name] = e
    ratios: dict[str, Any] = {}
    for stage, off in CONFIGS:
        cfg = config_name(stage, off)
        peers = [(f"upstream {cfg}", "upstream")]
        if (stage, off) == (1, False):
            peers.append(("torch ZeRO-R (stage 1)", "zero_redundancy"))
        ours = per.get(f"ours {cfg}", {})
        for peer_name, peer in peers:
            other = per.get(peer_name, {})
            if "median_steps_per_s" not in ours or "median_steps_per_s" not in other:
                continue
            ratios[f"{cfg} vs {peer}"] = {
                "ours_over_peer_steps_per_s": ours["median_steps_per_s"]
                / other["median_steps_per_s"],
                "per_round": [
                    o / p
                    for o, p in zip(
                        contenders[f"ours {cfg}"].steps_per_s, contenders[peer_name].steps_per_s
                    )
                ],
                "ours_over_peer_peak_rss_job": max(ours["peak_rss_job_bytes"])
                / max(other["peak_rss_job_bytes"]),
                "ours_over_peer_peak_rss_steady": max(ours["peak_rss_steady_bytes"])
                / max(other["peak_rss_steady_bytes"]),
                # the job peak less the RSS after imports (upstream imports ~30 MB more)
                "ours_over_peer_peak_rss_above_base": max(
                    j - b
                    for j, b in zip(ours["peak_rss_job_bytes"], ours["rss_after_import_bytes"])
                )
                / max(
                    j - b
                    for j, b in zip(other["peak_rss_job_bytes"], other["rss_after_import_bytes"])
                ),
            }
    return {"params": psi, "contenders": per, "ratios": ratios}


def report(summary: dict[str, Any], args: argparse.Namespace, limits: dict[str, float]) -> None:
    m, per, ratios, psi = args.model, summary["contenders"], summary["ratios"], summary["params"]
    print(
        f"\n== zero_step: GPT {m['n_layer']}L d{m['d_model']} h{m['n_head']} seq {m['seq']} vocab "
        f"{m['vocab']} ({psi / 1e6:.2f}M params), fp32 AdamW, micro-batch {args.micro_batch} x "
        f"{args.ranks} CPU ranks, OMP_NUM_THREADS={args.threads}, {args.rounds} round(s) x "
        f"{args.steps} steps (+{args.warmup} warmup), median over rounds; MB = 2^20 B =="
    )

    def mb(xs: list[float]) -> str:
        return "/".join(f"{x / MB:.0f}" for x in xs)

    rows = []
    for name, e in per.items():
        if "median_steps_per_s" not in e:
            state = "failed" if e["impl"] != "upstream" or e["jobs"] else "skipped"
            rows.append([name, state, *[""] * 9])
            continue
        cfg = config_name(e["stage"], e["offload"])
        vs_up = vs_zr = ""
        if e["impl"] == "ours":
            r = ratios.get(f"{cfg} vs upstream")
            vs_up = f"{r['ours_over_peer_steps_per_s']:.2f}x" if r else "-"
            if (e["stage"], e["offload"]) == (1, False):
                r = ratios.get(f"{cfg} vs zero_redundancy")
                vs_zr = f"{r['ours_over_peer_steps_per_s']:.2f}x" if r else "-"
        f = e["model_state_bytes_per_rank"]
        opt = e["opt_state_bytes_rank0"] + e["opt_master_bytes_rank0"]
        rows.append(
            [
                name,
                f"{e['median_steps_per_s']:.3f}",
                " ".join(f"{x:.3f}" for x in e["steps_per_s_per_round"]),
                vs_up,
                vs_zr,
                mb(e["peak_rss_job_bytes"]),
                mb(e["peak_rss_steady_bytes"]),
                mb(e["rss_after_import_bytes"][:1]),
                f"{opt / MB:.0f}",
                f"{f['formula'] / MB:.0f} ({f['with_master_copy'] / MB:.0f})",
                f"{e['final_loss']:.4f}",
            ]
        )
    heads = ["contender", "steps/s", "per round", "ours/upstr", "ours/ZeRO-R"]
    heads += ["peak job r0/r1", "steady r0/r1", "base r0", "opt MB", "formula MB", "last loss"]
    print_table(heads, rows)
    print(
        "peak job = VmHWM over the whole job; steady = VmHWM over the timed steps (reset after "
        "setup + warmup); base = VmRSS after imports (MB per rank). opt MB = rank 0 optimizer "
        "m, v + separate fp32 master copy. formula MB = fp32 AdamW model states per rank: "
        "16Psi | 8Psi + 8Psi/N | 4Psi + 12Psi/N (with the 4Psi/N master copy in parentheses)"
    )
    bw, gemm = limits["copy_gbps"], limits["gemm_gflops_mlp_shape"]
    floor0 = 28 * psi / (bw * 1e9)
    print(
        f"limits (1 thread): copy {bw:.1f} GB/s -> Adam floor {floor0 * 1e3:.0f} ms/step for Psi, "
        f"{floor0 / args.ranks * 1e3:.0f} ms for Psi/{args.ranks}; GEMM {gemm:.1f} GFLOP/s -> "
        f"forward+backward floor {model_flops(args) / (gemm * 1e9) * 1e3:.0f} ms/step"
    )
    for name, e in per.items():
        bad = [j["exit_after_result"]["rc"] for j in e["jobs"] if "exit_after_result" in j]
        if bad:
            print(f"{name}: {len(bad)}/{len(e['jobs'])} job(s) exited rc {bad} after the result")
        if e["skipped"]:
            print(f"{name}: skipped ({e['skipped'][-400:]})")
    print(
        f"target (issue): ours >= {TARGET:.1f}x upstream steps/s at no more memory (max-rank peak)"
    )
    for key, r in ratios.items():
        if not key.endswith("upstream"):
            continue
        got, mem_job = r["ours_over_peer_steps_per_s"], r["ours_over_peer_peak_rss_job"]
        verdict = "met" if got >= TARGET and mem_job <= 1.0 else "NOT met"
        print(
            f"  {key:<28} {got:.2f}x steps/s, memory ours/upstream job {mem_job:.2f}x, "
            f"steady {r['ours_over_peer_peak_rss_steady']:.2f}x, above base "
            f"{r['ours_over_peer_peak_rss_above_base']:.2f}x   {verdict}"
        )


def main() -> int:
    args = parse_args()
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    t_start = time.perf_counter()
    run_id = f"zerostep-{uuid.uuid4().hex[:12]}"
    contenders: dict[str, ZeroContender] = {}
    for impl in ("ours", "upstream"):
        for stage, off in CONFIGS:
            c = ZeroContender(impl, stage, off, args, run_id)
            contenders[c.name] = c
    zr = ZeroContender("zero_redundancy", 1, False, args, run_id)
    contenders[zr.name] = zr
    limit_runs: list[dict[str, float]] = []
    try:
        limit_runs = run_rounds(contenders, args.rounds, lambda: measure_limits(args), t_start)
    finally:
        leftover = reap(run_id)
    limits = median_limits(limit_runs)
    summary = summarize(contenders, args)
    if limits:
        report(summary, args, limits)
    wall = time.perf_counter() - t_start
    payload = {
        "benchmark": "zero_step",
        "workload": {
            "model": {**args.model, "params": summary["params"], "tied_embeddings": True},
            "dtype": "fp32",
            "optimizer": {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01},
            "micro_batch_per_rank": args.micro_batch,
            "ranks": args.ranks,
            "omp_num_threads_per_rank": args.threads,
            "rounds": args.rounds,
            "steps_per_job": args.steps,
            "warmup_per_job": args.warmup,
            "model_flops_per_step_per_rank": model_flops(args),
            "memory": "VmHWM per rank: job = whole job; steady = timed steps only (clear_refs 5 "
            "after setup + warmup); bytes, medians over rounds, index = rank",
            "model_state_formula": "fp32 AdamW: params 4Psi + grads 4Psi (4Psi/N stage>=2) + "
            "m,v 8Psi (8Psi/N stage>=1); with_master_copy adds 4Psi/N for stages 1-2",
            "smoke": args.smoke,
            "commands": {n: c.command(0)[0] for n, c in contenders.items()},  # port 0: per job
        },
        "machine": machine_info("cpu"),
        "limits_1thread": {"median": limits, "per_round": limit_runs},
        "targets": {"ours_over_upstream_steps_per_s": TARGET, "ours_over_upstream_peak_rss": 1.0},
        **summary,
        "leftover_pids_killed_at_end": leftover,
        "busy_warning": warning,
        "wall_s": wall,
    }
    name = "zero_step" if args.ranks == 2 else f"zero_step_{args.ranks}ranks"
    return finish(name, payload, contenders, args.smoke)


if __name__ == "__main__":
    sys.exit(main())

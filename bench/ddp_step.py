"""Benchmark: data-parallel training steps/s of our engine against torch DDP and upstream
DeepSpeed, 2 CPU ranks, ZeRO stage 0.

Workload: the tiny GPT of examples/gpt.py (4 layers, d_model 128, 4 heads, seq 64, vocab 64,
tied embeddings, 0.81M params), micro-batch 16 per rank, 2 ranks (gloo), random token
batches from a fixed seed per (rank, step). Cases fp32 and bf16. Contenders, each run as
its own 2-rank job of bench/peers/ddp_step_worker.py (one job per contender per round):
  ours      deepspeed_ext engine (`deepspeed.initialize`, this repo's face), config
            optimizer AdamW, zero stage 0, bf16 {enabled} for bf16; our `deepspeed`
            launcher (deepspeed --num_gpus 2)
  ddp       torch DistributedDataParallel + torch.optim.AdamW with torch's default
            implementation (on CPU params: the single-tensor for-loop; --ddp-adamw picks
            fused/foreach); bf16 = fp32 params under torch.autocast(cpu, bfloat16) (or a
            bf16 model: --ddp-bf16 model); python -m torch.distributed.run --nproc_per_node 2
  upstream  deepspeed==0.19.8 with the same config, in its own venv (DS_ACCELERATOR=cpu,
            cwd outside the repo, no PYTHONPATH); the venv's torch.distributed.run
What a step does differs in the details (all three do forward, backward, a gradient
all-reduce over gloo, AdamW, no clipping; the losses agree, see the table):
  ours      grads accumulate (hooks) into one flat fp32 bucket (the whole model fits the
            default 25 MB bucket), all-reduced in fp32, global grad norm computed every
            step; DeepSpeedCPUAdam on fp32 masters; bf16: bf16 model, fp32 masters and fp32
            grad buckets, masters copied back into the bf16 model each step
  ddp       DDP's bucketed fp32 all-reduce overlapped with backward; bf16 autocast casts the
            fp32 weights to bf16 in every forward
  upstream  stage 0 all-reduce after backward; fp32: FusedAdam (upstream's CPU JIT op);
            bf16: its DDP_BFLOAT16 path, FP16_Optimizer over FusedAdam (bf16 grads all-reduced
            in bf16, fp32 masters, grad norm every step)
Every rank runs with OMP_NUM_THREADS=1 (2 ranks on 2 cores). Rank 0 times --steps steps
after --warmup untimed ones, between two barriers, and prints one JSON line. Contenders
alternate over --rounds rounds (order reversed every other round); the medians over rounds
give steps/s and samples/s, and ours/peer ratios of steps/s. The physical limit measured
in this process: single-thread GEMM throughput at the model's largest layer shape, against
the model's FLOPs per step (6 x matmul params x tokens + attention).

    python bench/ddp_step.py                        # full run -> bench/results/ddp_step.json
    python bench/ddp_step.py --smoke --no-upstream  # one round of a few steps

Upstream runs from ${DS_UPSTREAM_VENV:-~/.cache/deepspeed_ext/upstream-venv} (create it with
bench/peers/setup_upstream.sh, which also JIT-builds the ops this needs; otherwise the first
upstream job builds fused_adam and deepspeed_shm_comm, ~3 min); without it the peer is
recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from common import (
    busy_warning,
    machine_info,
    median,
    print_table,
    progress,
    upstream_python,
    write_result,
)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = BENCH / "peers" / "ddp_step_worker.py"
RESULT_TAG = "DDP_STEP_RESULT "
IMPLS = ("ours", "ddp", "upstream")
CASES = ("fp32", "bf16")
# ours steps/s over the peer's, from the issue
TARGETS = {"ddp": 1.0, "upstream": 1.2}
MODEL = dict(n_layer=4, d_model=128, n_head=4, seq=64, vocab=64)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one round of a few steps")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream peer")
    ap.add_argument("--cases", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=16, help="timed optimizer steps per job")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first, per job")
    ap.add_argument("--micro-batch", type=int, default=16, help="per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument(
        "--ddp-adamw",
        choices=("default", "fused", "foreach", "loop"),
        default="default",
        help="the DDP peer's torch.optim.AdamW: as constructed by default, or forced",
    )
    ap.add_argument(
        "--ddp-bf16",
        choices=("autocast", "model"),
        default="autocast",
        help="the DDP peer's bf16: fp32 params under bf16 autocast, or a pure bf16 model",
    )
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases or any(c not in CASES for c in args.cases):
        ap.error(f"--cases takes a comma list of {', '.join(CASES)}")
    if min(args.rounds, args.steps, args.ranks, args.threads) < 1 or args.warmup < 0:
        ap.error("need rounds, steps, ranks, threads >= 1 and warmup >= 0")
    return args


# -- the physical limit: GEMM throughput ----------------------------------------------------


def model_flops_per_step(args: argparse.Namespace) -> float:
    """FLOPs of one training step on one rank: 6 x (matmul params) x tokens for the linear
    layers (forward 2, backward 4) plus the attention products QK^T and AV (2 x 2 T^2 d per
    sample and layer forward, x3 with backward), counted dense (no causal saving)."""
    d, L, T, V = MODEL["d_model"], MODEL["n_layer"], MODEL["seq"], MODEL["vocab"]
    tokens = args.micro_batch * T
    matmul_params = L * 12 * d * d + V * d  # qkv 3d^2, proj d^2, mlp 8d^2; tied head
    return 6.0 * matmul_params * tokens + 12.0 * L * args.micro_batch * T * T * d


def gemm_gflops(dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 0.4) -> float:
    """Median GFLOP/s of an (m x k) @ (k x n) matmul with torch's current thread count."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * m * k * n / median(times) / 1e9


def measure_limits(args: argparse.Namespace) -> dict[str, float]:
    """Per-thread GEMM GFLOP/s at the MLP's shape ([tokens, d] @ [d, 4d]) and at 1024^3."""
    m, d = args.micro_batch * MODEL["seq"], MODEL["d_model"]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return {
            "fp32_mlp_shape": gemm_gflops(torch.float32, m, d, 4 * d),
            "bf16_mlp_shape": gemm_gflops(torch.bfloat16, m, d, 4 * d),
            "fp32_1024": gemm_gflops(torch.float32, 1024, 1024, 1024),
            "bf16_1024": gemm_gflops(torch.bfloat16, 1024, 1024, 1024),
        }
    finally:
        torch.set_num_threads(threads)


# -- jobs ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pids_with(tag: str) -> list[int]:
    """Live processes whose command line contains `tag` (this driver's run id)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if tag.encode() in cmdline:
            found.append(int(entry.name))
    return found


def reap(tag: str, grace_s: float = 5.0) -> list[int]:
    """Stop every process of ours still carrying `tag` (SIGTERM, then SIGKILL); returns the
    pids that were found alive."""
    left = pids_with(tag)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_with(tag):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        t_end = time.perf_counter() + grace_s
        while pids_with(tag) and time.perf_counter() < t_end:
            time.sleep(0.1)
        if not pids_with(tag):
            break
    return left


class Contender:
    """One (implementation, case): how to start its 2-rank job, and its results. Subclasses
    (bench/zero_step.py) swap the worker, its result tag and which impls torchrun starts."""

    worker = WORKER
    result_tag = RESULT_TAG
    torchrun_impls: tuple[str, ...] = ("ddp",)

    def __init__(self, impl: str, case: str, args: argparse.Namespace, run_id: str) -> None:
        self.impl, self.case, self.args = impl, case, args
        self.name = f"{impl} {case}"
        self.run_id = run_id
        self.results: list[dict[str, Any]] = []  # per round: the worker's JSON
        self.jobs: list[dict[str, Any]] = []  # per round: wall time, return code
        self.skipped: str | None = None
        if impl == "upstream":
            if args.no_upstream:
                self.skipped = "--no-upstream"
            elif not upstream_python().exists():
                self.skipped = (
                    f"no upstream venv at {upstream_python().parent.parent}; "
                    "run bench/peers/setup_upstream.sh (or set DS_UPSTREAM_VENV)"
                )

    def worker_args(self) -> list[str]:
        a = self.args
        out = [
            str(self.worker),
            *("--impl", self.impl, "--dtype", self.case),
            *("--steps", str(a.steps), "--warmup", str(a.warmup)),
            *("--micro-batch", str(a.micro_batch), "--run-id", self.run_id),
        ]
        for key in ("n_layer", "d_model", "n_head", "seq", "vocab"):
            out += [f"--{key.replace('_', '-')}", str(MODEL[key])]
        if self.impl == "ddp":
            out += ["--ddp-adamw", a.ddp_adamw, "--ddp-bf16", a.ddp_bf16]
        return out

    def command(self, port: int) -> tuple[list[str], dict[str, str], str | None]:
        """argv, environment and cwd (None: the repository root) of one job."""
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.args.threads)
        n = str(self.args.ranks)
        rdzv = ["--nproc_per_node", n, "--master_addr", "127.0.0.1", "--master_port", str(port)]
        if self.impl == "ours":
            launcher = shutil.which("deepspeed")
            runner = (
                [launcher] if launcher else [sys.executable, "-m", "deepspeed_ext.launcher.runner"]
            )
            argv = [*runner, "--num_gpus", n, "--master_port", str(port), *self.worker_args()]
            return argv, env, None
        if self.impl in self.torchrun_impls:
            argv = [sys.executable, "-m", "torch.distributed.run", *rdzv, *self.worker_args()]
            return argv, env, None
        env.pop("PYTHONPATH", None)
        env["DS_ACCELERATOR"] = "cpu"
        argv = [str(upstream_python()), "-P", "-m", "torch.distributed.run", *rdzv]
        return [*argv, *self.worker_args()], env, "tmp"

    def run_round(self) -> None:
        """One 2-rank job; a failed job (e.g. a port taken by someone else between our
        probe and the bind) is retried once, the failure kept in the job record."""
        if self.skipped:
            return
        job, out, err = self._job()
        if job["rc"] != 0 or self.result_tag not in out:
            first = {**job, "stderr_tail": err.strip()[-1500:]}
            print(f"  {self.name}: job failed (rc {job['rc']}), retrying once", file=sys.stderr)
            job, out, err = self._job()
            job["failed_attempt"] = first
        self.jobs.append(job)
        lines = [ln for ln in out.splitlines() if ln.startswith(self.result_tag)]
        if job["rc"] != 0 or not lines:
            self.skipped = f"job failed (rc {job['rc']}): {err.strip()[-1500:]}"
            print(f"  {self.name}: {self.skipped}", file=sys.stderr)
            return
        self.results.append(json.loads(lines[-1][len(self.result_tag) :]))

    def _job(self) -> tuple[dict[str, Any], str, str]:
        port = free_port()
        argv, env, cwd = self.command(port)
        t0 = time.perf_counter()
        job: dict[str, Any] = {"port": port}
        proc = None
        with tempfile.TemporaryDirectory(prefix="ds_ddp_step_") as tmp:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=tmp if cwd == "tmp" else ROOT,  # upstream: never inside the repo
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                try:
                    out, err = proc.communicate(timeout=self.args.job_timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGTERM)
                    reap(self.run_id)  # the ranks run in sessions of their own
                    out, err = proc.communicate(timeout=30)
                    err += f"\n(timed out after {self.args.job_timeout:.0f} s)"
            except OSError as e:
                out, err = "", f"could not start: {e}"
        job["wall_s"] = time.perf_counter() - t0
        job["rc"] = proc.returncode if proc else None
        leftover = reap(self.run_id)
        if leftover:
            job["leftover_pids_killed"] = leftover
        job["stderr_warnings"] = warnings_in(err)
        return job, out, err

    @property
    def steps_per_s(self) -> list[float]:
        return [r["steps_per_s"] for r in self.results]


def warnings_in(text: str, limit: int = 20) -> list[str]:
    """The distinct lines of a job's stderr that look like warnings (for the report)."""
    seen: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s and ("warn" in s.lower() or "deprecat" in s.lower()) and s not in seen:
            seen.append(s[:300])
        if len(seen) >= limit:
            break
    return seen


# -- report --------------------------------------------------------------------------------


def summarize(
    contenders: dict[str, Contender], args: argparse.Namespace, flops: float
) -> dict[str, Any]:
    samples_per_step = args.micro_batch * args.ranks
    per: dict[str, Any] = {}
    for name, c in contenders.items():
        done = bool(c.results) and len(c.results) == len(c.jobs) and not c.skipped
        entry: dict[str, Any] = {
            "impl": c.impl,
            "case": c.case,
            "skipped": c.skipped,
            "jobs": c.jobs,
            "raw": c.results,
            "steps_per_s_per_round": c.steps_per_s,
        }
        if done:
            sps = median(c.steps_per_s)
            entry |= {
                "median_steps_per_s": sps,
                "median_samples_per_s": sps * samples_per_step,
                "median_step_s_pooled": median([t for r in c.results for t in r["step_s"]]),
                "model_gflops_per_s_per_rank": sps * flops / 1e9,
                "optimizer": c.results[0].get("optimizer"),
                "base_optimizer": c.results[0].get("base_optimizer"),
                "optimizer_resolved": c.results[0].get("optimizer_resolved"),
                "param_dtype": c.results[0].get("param_dtype"),
                "final_loss": c.results[0].get("final_loss"),
                "autocast": c.results[0].get("autocast"),
                "threads_per_rank": c.results[0].get("threads"),
            }
        per[name] = entry
    ratios: dict[str, dict[str, Any]] = {}
    for case in args.cases:
        ours = per.get(f"ours {case}", {})
        ratios[case] = {}
        for peer in ("ddp", "upstream"):
            other = per.get(f"{peer} {case}", {})
            if "median_steps_per_s" in ours and "median_steps_per_s" in other:
                ratios[case][peer] = {
                    "ours_over_peer": ours["median_steps_per_s"] / other["median_steps_per_s"],
                    "per_round": [
                        o / p
                        for o, p in zip(
                            contenders[f"ours {case}"].steps_per_s,
                            contenders[f"{peer} {case}"].steps_per_s,
                        )
                    ],
                    "target": TARGETS[peer],
                }
    return {"contenders": per, "ratios": ratios}


def report(summary: dict[str, Any], args: argparse.Namespace, limits: dict[str, float]) -> None:
    per, ratios = summary["contenders"], summary["ratios"]
    print(
        f"\n== ddp_step: GPT {MODEL['n_layer']}L d{MODEL['d_model']} seq {MODEL['seq']} vocab "
        f"{MODEL['vocab']}, micro-batch {args.micro_batch} x {args.ranks} CPU ranks, "
        f"OMP_NUM_THREADS={args.threads} per rank, {args.rounds} round(s) x {args.steps} steps "
        f"(+{args.warmup} warmup), median over rounds =="
    )
    rows = []
    for name, e in per.items():
        if "median_steps_per_s" not in e:
            rows.append([name, "skipped", "", "", "", "", "", ""])
            continue
        case = e["case"]
        lim = limits[f"{case}_mlp_shape"]
        r = ratios.get(case, {})
        if e["impl"] == "ours":
            vs = [f"{r[p]['ours_over_peer']:.2f}x" if p in r else "-" for p in ("ddp", "upstream")]
        else:
            vs = ["", ""]
        rows.append(
            [
                name,
                f"{e['median_steps_per_s']:.2f}",
                f"{e['median_samples_per_s']:.0f}",
                " ".join(f"{x:.2f}" for x in e["steps_per_s_per_round"]),
                f"{e['model_gflops_per_s_per_rank'] / lim:.0%}",
                f"{e['final_loss']:.4f}",
                *vs,
            ]
        )
    print_table(
        [
            "contender",
            "steps/s",
            "samples/s",
            "per round",
            "of GEMM",
            "last loss",
            "ours/ddp",
            "ours/upstream",
        ],
        rows,
    )
    print(
        f"limit (1 thread, GEMM at [{args.micro_batch * MODEL['seq']}, {MODEL['d_model']}] x "
        f"[{MODEL['d_model']}, {4 * MODEL['d_model']}]): fp32 {limits['fp32_mlp_shape']:.1f}, "
        f"bf16 {limits['bf16_mlp_shape']:.1f} GFLOP/s (1024^3: fp32 {limits['fp32_1024']:.1f}, "
        f"bf16 {limits['bf16_1024']:.1f}); 'of GEMM' = model FLOP/s per rank over it; "
        "'last loss' = rank 0's loss at the last timed step of round 1 (same data for all)"
    )
    for name, e in per.items():
        if e.get("skipped"):
            print(f"{name}: skipped ({e['skipped'][:300]})")
    seen = set()
    for e in per.values():
        if "optimizer" in e and (e["impl"], e["case"]) not in seen:
            seen.add((e["impl"], e["case"]))
            opt = e["optimizer"] + (f" over {e['base_optimizer']}" if e["base_optimizer"] else "")
            if e["optimizer_resolved"]:
                opt += f" (resolved: {e['optimizer_resolved']})"
            extra = f", autocast {e['autocast']}" if e.get("autocast") else ""
            print(f"  {e['impl']} {e['case']}: {opt}; params {e['param_dtype']}{extra}")
    print("targets (issue): ours steps/s over the peer's")
    for case in args.cases:
        for peer, target in TARGETS.items():
            got = ratios.get(case, {}).get(peer, {}).get("ours_over_peer")
            verdict = "n/a" if got is None else ("met" if got >= target else "NOT met")
            shown = "-" if got is None else f"{got:.2f}x"
            print(f"  {case} vs {peer:<9} >= {target:.1f}x   got {shown:>6}  {verdict}")


def run_rounds(
    contenders: dict[str, Any], rounds: int, measure: Any, t_start: float
) -> list[dict[str, float]]:
    """Every contender once per round, in reverse order every other round; the machine's
    limits measured (measure()) after each round. Returns those measurements."""
    names = list(contenders)
    limit_runs: list[dict[str, float]] = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in progress(order, len(order), f"round {r + 1}/{rounds}"):
            contenders[name].run_round()
        limit_runs.append(measure())
        print(
            f"  round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)",
            file=sys.stderr,
        )
    return limit_runs


def median_limits(limit_runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: median([x[k] for x in limit_runs]) for k in limit_runs[0]} if limit_runs else {}


def finish(name: str, payload: dict[str, Any], contenders: dict[str, Any], smoke: bool) -> int:
    """Write the result, repeat a busy warning last, and exit 1 if one of ours failed."""
    path = write_result(name, payload, smoke=smoke)
    if payload.get("busy_warning"):
        print(payload["busy_warning"])
    print(f"\nwrote {path} ({payload['wall_s']:.0f} s)")
    failed = [n for n, c in contenders.items() if c.skipped and c.impl != "upstream"]
    return 1 if failed else 0


def main() -> int:
    args = parse_args()
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    t_start = time.perf_counter()
    run_id = f"ddpstep-{uuid.uuid4().hex[:12]}"
    contenders = {
        f"{impl} {case}": Contender(impl, case, args, run_id)
        for case in args.cases
        for impl in IMPLS
    }
    limit_runs: list[dict[str, float]] = []
    try:
        limit_runs = run_rounds(contenders, args.rounds, lambda: measure_limits(args), t_start)
    finally:
        leftover = reap(run_id)
    limits = median_limits(limit_runs)
    flops = model_flops_per_step(args)
    summary = summarize(contenders, args, flops)
    if limits:
        report(summary, args, limits)
    wall = time.perf_counter() - t_start
    params = next((c.results[0]["params"] for c in contenders.values() if c.results), None)
    payload = {
        "benchmark": "ddp_step",
        "workload": {
            "model": {**MODEL, "params": params, "tied_embeddings": True},
            "micro_batch_per_rank": args.micro_batch,
            "ranks": args.ranks,
            "samples_per_step": args.micro_batch * args.ranks,
            "omp_num_threads_per_rank": args.threads,
            "cases": args.cases,
            "rounds": args.rounds,
            "steps_per_job": args.steps,
            "warmup_per_job": args.warmup,
            "ddp_adamw": args.ddp_adamw,
            "ddp_bf16": args.ddp_bf16,
            "model_flops_per_step_per_rank": flops,
            "smoke": args.smoke,
            "commands": {n: c.command(0)[0] for n, c in contenders.items()},  # port 0: per job
        },
        "machine": machine_info("cpu"),
        "limits_gemm_gflops_1thread": {"median": limits, "per_round": limit_runs},
        "targets": {"ours_over_peer_steps_per_s": TARGETS},
        **summary,
        "leftover_pids_killed_at_end": leftover,
        "busy_warning": warning,
        "wall_s": wall,
    }
    return finish("ddp_step", payload, contenders, args.smoke)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: our DeepSpeedCPUAdam against torch's AdamW and upstream DeepSpeed's CPU Adam.

Workload: 64M params split evenly over 16 tensors (configurable), two cases:
  fp32  params, grads, exp_avg, exp_avg_sq all fp32            28 B/param moved
  bf16  bf16 params and grads, fp32 states (ours and upstream)  22 B/param moved
        (torch's AdamW keeps bf16 states for bf16 params: 14 B/param, a lighter workload)

Contenders, alternating in rounds (order reversed every other round), each timing
`--steps` optimizer steps per round after `--warmup` untimed ones; median step time over
all rounds (the slow torch loop times only `--loop-steps` per round, to keep the run short):
  ours      deepspeed_ext.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)
  torch     torch.optim.AdamW(fused=True), torch.optim.AdamW(foreach=False)
  upstream  deepspeed==0.19.8 DeepSpeedCPUAdam, one subprocess per round in its own venv
            (bench/peers/upstream_cpu_adam.py; its time is the same opt.step() wall time)
The in-process contenders share the params and grads (the step time does not depend on
their values); each has its own states. Every round also measures the copy bandwidth and
an in-place read-modify-write bandwidth in this process, the physical limit.

    python bench/cpu_adam.py            # full run, writes bench/results/cpu_adam.json
    python bench/cpu_adam.py --smoke    # 1M params, writes bench/results/cpu_adam_smoke.json

Upstream runs from ${DS_UPSTREAM_VENV:-~/.cache/deepspeed_ext/upstream-venv}; without it
the peer is recorded as skipped (create it with bench/peers/setup_upstream.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    Bandwidth,
    busy_warning,
    copy_bandwidth,
    machine_info,
    median,
    print_table,
    rmw_bandwidth,
    time_s,
    upstream_python,
    write_result,
)

BENCH = Path(__file__).resolve().parent
PEER_SCRIPT = BENCH / "peers" / "upstream_cpu_adam.py"
OURS = "ours DeepSpeedCPUAdam"
UPSTREAM = "upstream DeepSpeedCPUAdam"
TORCH_FUSED = "torch AdamW(fused=True)"
TORCH_LOOP = "torch AdamW(foreach=False)"
HP: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# speedup = peer time / our time; from the issue
TARGET_SPEEDUP = {UPSTREAM: 1.2, TORCH_FUSED: 1.5}
TARGET_BW_FRACTION = 0.8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="1M params, fewer repetitions")
    ap.add_argument("--params", type=int, default=64 * 2**20, help="total parameters")
    ap.add_argument("--tensors", type=int, default=16, help="number of param tensors")
    ap.add_argument("--cases", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    ap.add_argument(
        "--loop-steps", type=int, default=2, help="timed steps per round of the slow AdamW loop"
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (states, op)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, also the peer's")
    ap.add_argument("--copy-mib", type=int, default=512, help="size of the bandwidth tensors")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream subprocess")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.rounds, args.steps, args.copy_mib = 2**20, 2, 3, 64
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases or any(c not in DTYPES for c in args.cases):
        ap.error(f"--cases takes a comma list of {', '.join(DTYPES)}")
    if not 1 <= args.tensors <= args.params or min(args.rounds, args.steps, args.loop_steps) < 1:
        ap.error("need 1 <= tensors <= params, rounds >= 1, steps >= 1, loop-steps >= 1")
    return args


def bytes_per_param(param: torch.dtype, grad: torch.dtype, state: torch.dtype) -> int:
    """Adam's traffic: read p, g, m, v; write p, m, v."""
    p, g, s = (torch.empty(0, dtype=d).element_size() for d in (param, grad, state))
    return 2 * p + g + 4 * s


class Upstream:
    """Runs bench/peers/upstream_cpu_adam.py once per round; never raises."""

    def __init__(self, args: argparse.Namespace, case: str) -> None:
        self.cmd = [
            str(upstream_python()),
            str(PEER_SCRIPT),
            *("--numel", str(args.params), "--dtype", case, "--tensors", str(args.tensors)),
            *("--reps", str(args.steps), "--warmup", str(args.warmup)),
            *("--threads", str(args.threads), "--lr", str(HP["lr"])),
            *("--weight-decay", str(HP["weight_decay"])),
        ]
        self.skipped: str | None = None
        self.calls: list[dict[str, Any]] = []  # per round: its JSON line and wall time
        if args.no_upstream:
            self.skipped = "--no-upstream"
        elif not upstream_python().exists():
            self.skipped = (
                f"no upstream venv at {upstream_python().parent.parent}; "
                "run bench/peers/setup_upstream.sh (or set DS_UPSTREAM_VENV)"
            )

    def run_round(self) -> list[float]:
        if self.skipped:
            return []
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = self.cmd[self.cmd.index("--threads") + 1]
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="ds_upstream_") as cwd:  # not in the repo
                proc = subprocess.run(
                    self.cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
                )
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, IndexError) as e:
            self.skipped = f"upstream peer failed: {e}"
            print(f"  {self.skipped}", file=sys.stderr)
            return []
        self.calls.append({"wall_s": wall, "result": out})
        return [float(t) for t in out["times_s"]]

    def state_dtype(self) -> torch.dtype | None:
        name = self.calls[0]["result"].get("state_dtype") if self.calls else None
        return getattr(torch, name) if name else None


def make_params(numel: int, tensors: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Split like the peer does: sizes differ by at most one."""
    gen = torch.Generator().manual_seed(0)
    base, extra = divmod(numel, tensors)
    params = []
    for i in range(tensors):
        n = base + (i < extra)
        p = torch.nn.Parameter(torch.empty(n, dtype=dtype).uniform_(-1.0, 1.0, generator=gen))
        p.grad = torch.empty(n, dtype=dtype).normal_(0.0, 1e-2, generator=gen)
        params.append(p)
    return params


def run_case(args: argparse.Namespace, case: str) -> dict[str, Any]:
    from deepspeed_ext.ops.adam import DeepSpeedCPUAdam

    dtype = DTYPES[case]
    params = make_params(args.params, args.tensors, dtype)
    opts: dict[str, torch.optim.Optimizer] = {
        OURS: DeepSpeedCPUAdam(params, adamw_mode=True, **HP),
        TORCH_FUSED: torch.optim.AdamW(params, fused=True, **HP),
        TORCH_LOOP: torch.optim.AdamW(params, foreach=False, **HP),
    }
    for opt in opts.values():  # loads our op, allocates and faults in the states
        for _ in range(args.warmup):
            opt.step()
    upstream = Upstream(args, case)

    names = [*opts, UPSTREAM]
    raw: dict[str, list[list[float]]] = {n: [] for n in names}  # [round][step] seconds
    bw: dict[str, list[Bandwidth]] = {"copy": [], "rmw": []}
    nbytes = args.copy_mib * 2**20
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if name == UPSTREAM:
                raw[name].append(upstream.run_round())
            else:
                step: Callable[[], Any] = opts[name].step
                steps = args.loop_steps if name == TORCH_LOOP else args.steps
                raw[name].append([time_s(step) for _ in range(steps)])
        bw["copy"].append(copy_bandwidth(nbytes, reps=3))
        bw["rmw"].append(rmw_bandwidth(nbytes, reps=3))
        print(f"  [{case}] round {r + 1}/{args.rounds} done", file=sys.stderr)

    limits = {
        k: Bandwidth(k, v[0].moved_bytes, [t for b in v for t in b.times_s]) for k, v in bw.items()
    }
    state_dtypes = {n: opts[n].state[params[0]]["exp_avg"].dtype for n in opts}
    state_dtypes[UPSTREAM] = upstream.state_dtype() or torch.float32
    bpp = {n: bytes_per_param(dtype, dtype, state_dtypes[n]) for n in names}
    timed = [n for n in names if raw[n] and all(raw[n])]
    med = {n: median([t for rd in raw[n] for t in rd]) for n in timed}
    gbps = {n: bpp[n] * args.params / med[n] / 1e9 for n in timed}
    ratios, per_round = {}, {}
    if OURS in med:
        for n in timed:
            if n != OURS:
                ratios[n] = med[n] / med[OURS]
                per_round[n] = [median(p) / median(o) for p, o in zip(raw[n], raw[OURS])]
    return {
        "case": case,
        "param_dtype": str(dtype).removeprefix("torch."),
        "state_dtype": {n: str(d).removeprefix("torch.") for n, d in state_dtypes.items()},
        "bytes_per_param": bpp,
        "raw_step_s": raw,
        "median_step_s": med,
        "params_per_s": {n: args.params / med[n] for n in timed},
        "effective_gbps": gbps,
        "limits": {
            k: {**b.as_dict(), "per_round": [x.gbps for x in bw[k]]} for k, b in limits.items()
        },
        "fraction_of_copy_bw": {n: g / limits["copy"].gbps for n, g in gbps.items()},
        "fraction_of_rmw_bw": {n: g / limits["rmw"].gbps for n, g in gbps.items()},
        "speedup_vs_peer": ratios,  # peer median time / our median time
        "speedup_vs_peer_per_round": per_round,
        "upstream": {"cmd": upstream.cmd, "skipped": upstream.skipped, "calls": upstream.calls},
    }


def report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    case, med = res["case"], res["median_step_s"]
    copy, rmw = res["limits"]["copy"]["median_gbps"], res["limits"]["rmw"]["median_gbps"]
    print(
        f"\n== {case}: {args.params:,} params in {args.tensors} tensors, {args.threads} threads, "
        f"{args.rounds} rounds x {args.steps} steps ({args.loop_steps} for the torch loop), "
        "median =="
    )
    print(f"limit: copy {copy:.1f} GB/s (read + write), in-place a += b {rmw:.1f} GB/s")
    rows = []
    for n in res["bytes_per_param"]:
        if n not in med:
            rows.append([n, "skipped", "", "", "", "", "", ""])
            continue
        ratio = res["speedup_vs_peer"].get(n)
        rows.append(
            [
                n,
                res["bytes_per_param"][n],
                f"{med[n] * 1e3:.2f}",
                f"{res['params_per_s'][n] / 1e9:.3f}",
                f"{res['effective_gbps'][n]:.1f}",
                f"{res['fraction_of_copy_bw'][n]:.0%}",
                f"{res['fraction_of_rmw_bw'][n]:.0%}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    heads = ["contender", "B/param", "median ms", "Gparam/s", "GB/s", "of copy", "of rmw"]
    print_table([*heads, "ours speedup"], rows)
    if res["upstream"]["skipped"]:
        print(f"upstream: skipped ({res['upstream']['skipped']})")
    if case == "bf16":
        print(
            "note: torch's AdamW keeps bf16 states for bf16 params (14 B/param, a lighter "
            "workload); ours and upstream keep fp32 states (22 B/param)."
        )
    print("targets (issue):")
    for peer, target in TARGET_SPEEDUP.items():
        got = res["speedup_vs_peer"].get(peer)
        verdict = "n/a" if got is None else ("met" if got >= target else "NOT met")
        shown = "-" if got is None else f"{got:.2f}x"
        print(f"  vs {peer:<26} >= {target:.1f}x   got {shown:>7}  {verdict}")
    frac = res["fraction_of_copy_bw"].get(OURS)
    if frac is not None:
        verdict = "met" if frac >= TARGET_BW_FRACTION else "NOT met"
        label = "ours of copy bandwidth"
        print(f"  {label:<29} >= {TARGET_BW_FRACTION:.0%}    got {frac:>6.0%}  {verdict}")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    t0 = time.perf_counter()
    cases = {c: run_case(args, c) for c in args.cases}
    for res in cases.values():
        report(args, res)
    wall = time.perf_counter() - t0
    payload = {
        "benchmark": "cpu_adam",
        "workload": {
            "params": args.params,
            "tensors": args.tensors,
            "cases": args.cases,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "steps_per_round_torch_loop": args.loop_steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "copy_mib": args.copy_mib,
            "smoke": args.smoke,
            "hyperparameters": {**HP, "betas": list(HP["betas"])},
        },
        "machine": machine_info("cpu"),
        "targets": {
            "speedup_vs_peer": TARGET_SPEEDUP,
            "fraction_of_copy_bw": TARGET_BW_FRACTION,
        },
        "cases": cases,
        "busy_warning": warning,
        "wall_s": wall,
    }
    path = write_result("cpu_adam", payload, smoke=args.smoke)
    if warning:
        print(warning)
    print(f"\nwrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

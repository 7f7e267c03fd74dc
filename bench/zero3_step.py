"""Benchmark: ZeRO stage 3 training steps/s and per-rank peak memory of our engine (stage 3
with upstream's defaults, stage 3 with parameters really released, stage 3 + CPU param and
optimizer offload) against upstream DeepSpeed 0.19.8 with the same three configs and torch
FSDP2 `fully_shard`, 2 CPU ranks, fp32.

Workload: the model of bench/zero_step.py (the GPT of examples/gpt.py, 14 layers, d_model
512, 8 heads, seq 128, vocab 8192, tied embeddings: 48,394,240 params, Psi), micro-batch 1
per rank, 2 ranks (gloo), AdamW (lr 1e-3, wd 0.01), random token batches from a fixed seed
per (rank, step). Each contender is its own 2-rank job of bench/peers/zero_step_worker.py
(--stage 3), launched as bench/zero_step.py does (ours: our `deepspeed --num_gpus 2`;
upstream: its venv's torch.distributed.run from a temp cwd, no PYTHONPATH,
DS_ACCELERATOR=cpu; FSDP2: torchrun), every rank OMP_NUM_THREADS=1. Configs of ours and
upstream: optimizer AdamW, zero_optimization {stage: 3, ...}, everything else default:
  stage 3              nothing more: upstream's defaults (stage3_param_persistence_threshold
                       1e5 keeps every bias/LayerNorm gathered, stage3_max_reuse_distance 1e9
                       keeps a module gathered until its backward)
  stage 3 partitioned  stage3_param_persistence_threshold 0, stage3_max_reuse_distance 0,
                       stage3_prefetch_bucket_size 3.2e6 (one block ahead, as FSDP2),
                       stage3_max_live_parameters 7e6, reduce_bucket_size 3.2e6: every
                       parameter released after each use, at most ~2 blocks gathered and
                       about a block of gradients in each reduce bucket (the memory target's
                       config; the default 5e7 prefetch gathers this whole 48M model ahead)
  stage 3 + offload    offload_param {device: cpu} + offload_optimizer {device: cpu}
  FSDP2                torch.distributed.fsdp.fully_shard on each Block, then the root, on
                       init_device_mesh("cpu", (2,)) (gloo), torch.optim.AdamW
Rank 0 times --steps steps after --warmup, between barriers; contenders alternate over
--rounds rounds (order reversed every other round); medians over rounds. Memory per rank as
zero_step measures it (VmHWM; 'job' = whole job, 'steady' = timed steps only, 'base' = VmRSS
after the imports); 'above base' = steady - base, the max over ranks. glibc keeps freed heap
memory (its mmap threshold rises to 32 MB after the first large free), so RSS also counts
freed tensors; a memory pass (one more job per contender after the rounds, 2 steps, untimed,
MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB so large tensors are unmapped when freed) gives the
'fixed mmap' columns. Memory target: fp32 AdamW stage-3 model states per rank, params 4Psi/N
+ grads 4Psi/N + m, v 8Psi/N = 16Psi/N (the fp32 shard is its own master), plus the
activations (bytes autograd saves in one forward of the same model and micro-batch,
measured in this process); the gathered parameters and gradient buckets are on top of it.
Limits measured here as in zero_step: 1-thread copy bandwidth and GEMM at the MLP's shape.

    python bench/zero3_step.py                        # full run -> bench/results/zero3_step.json
                                                      # (28 jobs of 17-37 s: ~11 min here)
    python bench/zero3_step.py --smoke --no-upstream  # tiny model, one round of a few steps
    python bench/zero3_step.py --ranks 4              # -> bench/results/zero3_step_4ranks.json
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
import zero_step as zs
from common import busy_warning, machine_info, print_table
from ddp_step import finish, median_limits, reap, run_rounds

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from ddp_step_worker import _load_gpt  # noqa: E402  (stdlib-only at import time)

# A block's weights are 12 d^2 = 3.1M elements: prefetch one block ahead, at most ~2 live,
# gradients reduced about a block at a time.
PARTITIONED = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 3_200_000,
    "stage3_max_live_parameters": 7_000_000,
    "reduce_bucket_size": 3_200_000,
}
# name -> (more zero_optimization keys, offload_param + offload_optimizer to the CPU)
CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    "stage 3": ({}, False),
    "stage 3 partitioned": (PARTITIONED, False),
    "stage 3 + offload": ({}, True),
}
FSDP2 = "torch FSDP2 fully_shard"
TARGETS = {"upstream": 1.2, "fsdp2": 1.0}  # ours steps/s over the peer's, from the issue
MEMORY_TARGET = 1.1  # ours (partitioned) steady above base <= 1.1 x (16Psi/N + activations)
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
MB = zs.MB


class Zero3Contender(zs.ZeroContender):
    """A zero_step contender at stage 3: a named config of CONFIGS, or FSDP2; `env` is added
    to every rank's environment (the memory pass)."""

    torchrun_impls = ("fsdp2",)

    def __init__(
        self, impl: str, config: str, args: Any, run_id: str, env: dict[str, str] | None = None
    ) -> None:
        self.extra, offload = CONFIGS.get(config, ({}, False))
        super().__init__(impl, 3, offload, args, run_id)
        self.config, self.env = config, env or {}
        self.name = FSDP2 if impl == "fsdp2" else f"{impl} {config}"

    def worker_args(self) -> list[str]:
        out = [*super().worker_args(), "--zero-json", json.dumps(self.extra)]
        return out + (["--offload-param"] if self.offload else [])

    def command(self, port: int) -> tuple[list[str], dict[str, str], str | None]:
        argv, env, cwd = super().command(port)
        return argv, {**env, **self.env}, cwd


def parse_args(doc: str | None = None, warmup: int = 1) -> argparse.Namespace:
    """doc and warmup: another benchmark's description and default warm-up steps."""
    ap = argparse.ArgumentParser(description=(doc or __doc__).split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round, few steps")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream peer")
    ap.add_argument("--no-memory-pass", action="store_true", help="skip the fixed-mmap jobs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per job")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps first, per job")
    ap.add_argument("--micro-batch", type=int, default=1, help="per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job")
    args = ap.parse_args()
    args.model = dict(zs.SMOKE_MODEL if args.smoke else zs.MODEL)
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if min(args.rounds, args.steps, args.ranks, args.threads) < 1 or args.warmup < 0:
        ap.error("need rounds, steps, ranks, threads >= 1 and warmup >= 0")
    return args


def activation_bytes(args: argparse.Namespace) -> int:
    """Bytes autograd saves for backward in one forward of the model (fp32, one rank's
    micro-batch), parameters excluded, each storage counted once."""
    from deepspeed_ext.runtime.memory_estimate import activation_bytes as saved_in_forward

    m = args.model
    GPT, GPTConfig = _load_gpt()
    torch.manual_seed(0)
    model = GPT(GPTConfig(m["vocab"], m["seq"], m["n_layer"], m["n_head"], m["d_model"]))
    x = torch.randint(0, m["vocab"], (args.micro_batch, m["seq"]))
    return saved_in_forward(model, x, x)


def max_above_base(e: dict[str, Any], key: str = "peak_rss_steady_bytes") -> float:
    return max(p - b for p, b in zip(e[key], e["rss_after_import_bytes"]))


def summarize(
    contenders: dict[str, Zero3Contender],
    memory: dict[str, Zero3Contender],
    args: argparse.Namespace,
    act: int,
) -> dict[str, Any]:
    """zero_step's per-contender entries (its formula replaced by stage 3's), the memory
    pass's figures under 'fixed_mmap', the ratios ours / upstream and ours / FSDP2."""
    per = zs.summarize(contenders, args)["contenders"]
    fixed = zs.summarize(memory, args)["contenders"] if memory else {}
    psi = next((c.results[0]["params"] for c in contenders.values() if c.results), 0)
    states = 16 * psi / args.ranks
    formula = {"model_states": states, "activations": act, "target_bytes": states + act}
    formula["with_master_copy"] = states + 4 * psi / args.ranks
    for name, e in per.items():
        e["config"] = contenders[name].config
        e["model_state_bytes_per_rank"] = formula
        if name in memory:
            fm = e["fixed_mmap"] = {"skipped": memory[name].skipped, "jobs": memory[name].jobs}
            f = fixed[name]
            if "peak_rss_steady_bytes" in f:
                keys = ("peak_rss_job_bytes", "peak_rss_steady_bytes", "rss_after_import_bytes")
                fm |= {k: f[k] for k in keys}
                fm["steady_above_base_over_target"] = max_above_base(f) / formula["target_bytes"]
        if "peak_rss_steady_bytes" in e:
            e["steady_above_base_over_target"] = max_above_base(e) / formula["target_bytes"]
    ratios: dict[str, Any] = {}
    for config in CONFIGS:
        ours = f"ours {config}"
        for peer, other in (("upstream", f"upstream {config}"), ("fsdp2", FSDP2)):
            a, b = per.get(ours, {}), per.get(other, {})
            if "median_steps_per_s" not in a or "median_steps_per_s" not in b:
                continue
            ratios[f"{config} vs {peer}"] = {
                "ours_over_peer_steps_per_s": a["median_steps_per_s"] / b["median_steps_per_s"],
                "per_round": [
                    x / y
                    for x, y in zip(contenders[ours].steps_per_s, contenders[other].steps_per_s)
                ],
                "target": TARGETS[peer],
                "ours_over_peer_steady_above_base": max_above_base(a) / max_above_base(b),
                "ours_over_peer_job_above_base": max_above_base(a, "peak_rss_job_bytes")
                / max_above_base(b, "peak_rss_job_bytes"),
            }
    return {"params": psi, "formula": formula, "contenders": per, "ratios": ratios}


def report(summary: dict[str, Any], args: argparse.Namespace, limits: dict[str, float]) -> None:
    m, per, ratios, psi = args.model, summary["contenders"], summary["ratios"], summary["params"]
    f = summary["formula"]
    print(
        f"\n== zero3_step: GPT {m['n_layer']}L d{m['d_model']} h{m['n_head']} seq {m['seq']} "
        f"vocab {m['vocab']} ({psi / 1e6:.2f}M params), fp32 AdamW, ZeRO stage 3, micro-batch "
        f"{args.micro_batch} x {args.ranks} CPU ranks, OMP_NUM_THREADS={args.threads}, "
        f"{args.rounds} round(s) x {args.steps} steps (+{args.warmup} warmup), median over "
        "rounds; MB = 2^20 B =="
    )

    def mb(xs: list[float]) -> str:
        return "/".join(f"{x / MB:.0f}" for x in xs)

    rows = []
    for name, e in per.items():
        if "median_steps_per_s" not in e:
            rows.append([name, "failed" if e["jobs"] else "skipped", *[""] * 12])
            continue
        vs = ["", ""]
        if e["impl"] == "ours":
            for i, peer in enumerate(("upstream", "fsdp2")):
                r = ratios.get(f"{e['config']} vs {peer}")
                vs[i] = f"{r['ours_over_peer_steps_per_s']:.2f}x" if r else "-"
        fm = e.get("fixed_mmap", {})
        fixed = ["", ""]
        if "peak_rss_steady_bytes" in fm:
            fixed = [f"{max_above_base(fm) / MB:.0f}", f"{fm['steady_above_base_over_target']:.2f}"]
        rows.append(
            [
                name,
                f"{e['median_steps_per_s']:.3f}",
                " ".join(f"{x:.3f}" for x in e["steps_per_s_per_round"]),
                *vs,
                mb(e["peak_rss_job_bytes"]),
                mb(e["peak_rss_steady_bytes"]),
                mb(e["rss_after_import_bytes"][:1]),
                f"{max_above_base(e) / MB:.0f}",
                f"{e['steady_above_base_over_target']:.2f}",
                *fixed,
                f"{(e['opt_state_bytes_rank0'] + e['opt_master_bytes_rank0']) / MB:.0f}",
                f"{e['final_loss']:.4f}",
            ]
        )
    heads = ["contender", "steps/s", "per round", "ours/upstr", "ours/FSDP2", "peak job r0/r1"]
    heads += ["steady r0/r1", "base r0", "above base", "/target", "fixed mmap", "/target"]
    print_table([*heads, "opt MB", "last loss"], rows)
    print(
        "peak job = VmHWM over the whole job (the model is built whole on every rank first); "
        "steady = VmHWM over the timed steps; base = VmRSS after imports; above base = max "
        "over ranks of steady - base; fixed mmap = the same from the memory pass "
        "(MALLOC_MMAP_THRESHOLD_=128 KiB, freed tensors unmapped); opt MB = rank 0 optimizer "
        "m, v + separate master copy (MB per rank)."
    )
    print(
        f"target = 16Psi/N {f['model_states'] / MB:.0f} MB (params 4 + grads 4 + Adam m,v 8 "
        f"B/param over N={args.ranks}; {f['with_master_copy'] / MB:.0f} MB with a separate "
        f"fp32 master copy) + activations {f['activations'] / MB:.0f} MB (saved for backward "
        f"in one forward) = {f['target_bytes'] / MB:.0f} MB"
    )
    bw, gemm = limits["copy_gbps"], limits["gemm_gflops_mlp_shape"]
    floor = 28 * psi / args.ranks / (bw * 1e9)
    print(
        f"limits (1 thread): copy {bw:.1f} GB/s -> Adam floor {floor * 1e3:.0f} ms/step for "
        f"Psi/{args.ranks}; GEMM {gemm:.1f} GFLOP/s -> forward+backward floor "
        f"{zs.model_flops(args) / (gemm * 1e9) * 1e3:.0f} ms/step"
    )
    for name, e in per.items():
        for label, jobs in (
            ("", e["jobs"]),
            (" memory pass", e.get("fixed_mmap", {}).get("jobs", [])),
        ):
            bad = [j["exit_after_result"]["rc"] for j in jobs if "exit_after_result" in j]
            if bad:
                print(
                    f"{name}{label}: {len(bad)}/{len(jobs)} job(s) exited rc {bad} after the result"
                )
        if e["skipped"]:
            print(f"{name}: skipped ({e['skipped'][-400:]})")
        if e.get("fixed_mmap", {}).get("skipped") and not e["skipped"]:
            print(f"{name}: memory pass failed ({e['fixed_mmap']['skipped'][-400:]})")
    print("targets (issue): ours >= 1.2x upstream, >= 1.0x FSDP2 steps/s; partitioned memory")
    for key, r in ratios.items():
        got = r["ours_over_peer_steps_per_s"]
        print(
            f"  {key:<34} {got:.2f}x steps/s (target {r['target']:.1f}x: "
            f"{'met' if got >= r['target'] else 'NOT met'}), memory above base ours/peer "
            f"steady {r['ours_over_peer_steady_above_base']:.2f}x, "
            f"job {r['ours_over_peer_job_above_base']:.2f}x"
        )
    ours = per.get("ours stage 3 partitioned", {})
    for label, e in (("default allocator", ours), ("fixed mmap", ours.get("fixed_mmap", {}))):
        if "steady_above_base_over_target" in e:
            got = e["steady_above_base_over_target"]
            print(
                f"  ours stage 3 partitioned memory ({label}): steady above base "
                f"{max_above_base(e) / MB:.0f} MB = {got:.2f}x target (<= {MEMORY_TARGET:.1f}x: "
                f"{'met' if got <= MEMORY_TARGET else 'NOT met'})"
            )


def main() -> int:
    args = parse_args()
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    t_start = time.perf_counter()
    act = activation_bytes(args)
    run_id = f"zero3step-{uuid.uuid4().hex[:12]}"
    contenders: dict[str, Zero3Contender] = {}
    for impl in ("ours", "upstream"):
        for config in CONFIGS:
            c = Zero3Contender(impl, config, args, run_id)
            contenders[c.name] = c
    contenders[FSDP2] = Zero3Contender("fsdp2", "", args, run_id)
    mem_args = argparse.Namespace(**{**vars(args), "steps": min(args.steps, 2)})
    memory = {
        n: Zero3Contender(c.impl, c.config, mem_args, run_id, env=MEMORY_ENV)
        for n, c in contenders.items()
    }
    limit_runs: list[dict[str, float]] = []
    try:
        limit_runs = run_rounds(contenders, args.rounds, lambda: zs.measure_limits(args), t_start)
        if args.no_memory_pass:
            memory = {}
        elif args.smoke:  # the target's config only, to keep the smoke run short
            memory = {n: c for n, c in memory.items() if n == "ours stage 3 partitioned"}
        for c in memory.values():
            c.run_round()
        print(f"  memory pass done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    finally:
        leftover = reap(run_id)
    limits = median_limits(limit_runs)
    summary = summarize(contenders, memory, args, act)
    if limits:
        report(summary, args, limits)
    wall = time.perf_counter() - t_start
    payload = {
        "benchmark": "zero3_step",
        "workload": {
            "model": {**args.model, "params": summary["params"], "tied_embeddings": True},
            "dtype": "fp32",
            "optimizer": {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01},
            "configs": {
                k: {"zero_optimization": {"stage": 3, **v[0]}, "offload": v[1]}
                for k, v in CONFIGS.items()
            },
            "micro_batch_per_rank": args.micro_batch,
            "ranks": args.ranks,
            "omp_num_threads_per_rank": args.threads,
            "rounds": args.rounds,
            "steps_per_job": args.steps,
            "warmup_per_job": args.warmup,
            "model_flops_per_step_per_rank": zs.model_flops(args),
            "smoke": args.smoke,
            "memory": "VmHWM per rank: job = whole job; steady = timed steps only (clear_refs 5 "
            "after setup + warmup); bytes, medians over rounds, index = rank; fixed_mmap = one "
            f"more job per contender, {mem_args.steps} steps, environment {MEMORY_ENV}",
            "memory_target": "steady - base (max over ranks) <= 1.1 x (16Psi/N + activations) "
            "for ours stage 3 partitioned",
            "commands": {n: c.command(0)[0] for n, c in contenders.items()},  # port 0: per job
        },
        "machine": machine_info("cpu"),
        "limits_1thread": {"median": limits, "per_round": limit_runs},
        "targets": {"ours_over_peer_steps_per_s": TARGETS, "memory_over_target": MEMORY_TARGET},
        **summary,
        "leftover_pids_killed_at_end": leftover,
        "busy_warning": warning,
        "wall_s": wall,
    }
    name = "zero3_step" if args.ranks == 2 else f"zero3_step_{args.ranks}ranks"
    return finish(name, payload, contenders, args.smoke)


if __name__ == "__main__":
    sys.exit(main())

"""Compressed communication against Adam's fp32 exchange, 2 ranks: 1-bit Adam, and Adam with
the gradient_compression section (1-bit, 2-bit, top-k with Huffman rows; at stage 0 and under
ZeRO 2 against ZeRO 2's fp32 reduce-scatter). Bytes on the wire per step, step time, and the
loss after the same steps, on loopback and on a rate-limited link (two network namespaces
joined by a veth pair with a tc rate limit, made here and removed after; needs root).

    python bench/compressed_comm.py                  # loopback and a 1 Gbit/s link
    python bench/compressed_comm.py --rate 500mbit
    python bench/compressed_comm.py --smoke          # tiny, loopback only (CI)

The model is communication-heavy on purpose: a wide MLP (16.8M params, 67 MB of fp32
gradients) on a small batch, so that an all-reduce of its gradients costs more than its
compute, as for a large model on a slow inter-node link. Each optimizer runs warm-up steps
(1-bit Adam: its AdamW warm-up up to freeze_step), then timed steps; wire bytes are the
comms logger's per-collective bytes times nccl-tests' bus factor ([Note: comms logger]),
what each rank actually sends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
from common import (  # noqa: E402
    busy_warning,
    machine_info,
    median,
    print_table,
    progress,
    upstream_python,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import torch

    from deepspeed_ext import comm
    from deepspeed_ext.comm.comms_logging import bus_factor
    from deepspeed_ext.runtime.initialize import initialize

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, layers = args.width, args.layers
    model = torch.nn.Sequential(
        *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    )
    config = {"train_micro_batch_size_per_gpu": args.batch, **CASES[args.optimizer]}
    params = config["optimizer"]["params"]
    if args.optimizer in ("onebit", "onebit-lamb"):
        params["freeze_step"] = args.warmup
    if args.optimizer == "zero-one":
        params.update(var_freeze_step=args.warmup, local_step_clipper=4)
    engine, *_ = initialize(model=model, config=config)
    teacher = torch.nn.Linear(width, width)
    gen = torch.Generator().manual_seed(1 + engine.dp_rank)

    def step() -> float:
        x = torch.randn(args.batch, width, generator=gen)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    for _ in range(args.warmup + 1):  # one compressed step beyond the warm-up, untimed
        step()
    comm.configure(enabled=True)
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    rows = comm.comms_logger.summary_rows()
    world = engine.dp_world_size
    wire = sum(
        size * r["count"] * bus_factor(op, world)
        for op, sizes in rows.items()
        for size, r in sizes.items()
    )
    if engine.dp_rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "step_s": times,
                    "wire_bytes_per_step": wire / args.steps,
                    "losses": losses,
                    "params": sum(p.numel() for p in model.parameters()),
                }
            )
        )
    engine.destroy()


ADAM = {"type": "Adam", "params": {"lr": 1e-3}}
ZERO2 = {"zero_optimization": {"stage": 2}}
TOPK = {"algorithm": "topk", "topk_ratio": 0.01, "huffman_coding": True}
# case -> config; each is compared with the fp32 case of its stage (BASELINE)
CASES: dict[str, dict[str, Any]] = {
    "adam": {"optimizer": ADAM},
    "onebit": {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
    # 0/1 Adam: every variance step kept through the warm-up, then local steps of up to 4
    "zero-one": {
        "optimizer": {
            "type": "ZeroOneAdam",
            "params": {"lr": 1e-3, "var_update_scaler": 1000, "local_step_scaler": 2},
        }
    },
    "lamb": {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
    "onebit-lamb": {"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}},
    "gc-1bit": {"optimizer": ADAM, "gradient_compression": {"algorithm": "1bit"}},
    "gc-2bit": {"optimizer": ADAM, "gradient_compression": {"algorithm": "2bit"}},
    "gc-topk": {"optimizer": ADAM, "gradient_compression": TOPK},
    "adam-z2": {"optimizer": ADAM, **ZERO2},
    "gc-topk-z2": {"optimizer": ADAM, "gradient_compression": TOPK, **ZERO2},
}
BASELINE = {c: "adam-z2" if c.endswith("-z2") else "lamb" if "lamb" in c else "adam" for c in CASES}


def run_pair(args: argparse.Namespace, optimizer: str, link: netns.Link | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        port = str(29700 + os.getpid() % 200)
        master = link.addresses[0] if link else "127.0.0.1"
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0" if link else str(rank),
                "MASTER_ADDR": master,
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            }
            if link:
                env["GLOO_SOCKET_IFNAME"] = (
                    f"dsx{link.namespaces[rank].split('-')[1][:6]}" + "ab"[rank]
                )
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--optimizer",
                optimizer,
                "--out",
                str(out),
                "--width",
                str(args.width),
                "--layers",
                str(args.layers),
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ]
            if link:
                procs.append(link.run_in(rank, argv, env=env))
            else:
                procs.append(subprocess.Popen(argv, env=env))
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise SystemExit(f"a {optimizer} rank failed: exit codes {codes}")
        return json.loads(out.read_text())


def upstream_peer() -> dict[str, Any]:
    """Upstream 0.19.8's OnebitAdam on this machine, each comm backend it offers: whether
    it runs, or what stops it (bench/peers/onebit_worker.py)."""
    from peers.onebit_worker import RESULT_TAG

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("PYTHONPATH", None)
    worker = Path(__file__).resolve().parent / "peers" / "onebit_worker.py"
    cmd = [str(upstream_python()), "-P", "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    r = subprocess.run(
        [*cmd, str(worker)], env=env, cwd="/tmp", capture_output=True, text=True, timeout=600
    )
    for line in r.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return {"error": f"the peer job failed (rc {r.returncode}): {r.stderr[-1500:]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", default="adam", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4, help="1-bit Adam's freeze_step")
    ap.add_argument("--rate", default="1gbit", help="the limited link's tc rate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream 0.19.8's run")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.width, args.layers, args.steps, args.warmup, args.rounds = 256, 2, 3, 2, 1
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; expected some of {list(CASES)}")
    cases = list(dict.fromkeys([*(BASELINE[c] for c in cases), *cases]))
    warn = busy_warning()
    if warn:
        print(warn)
    why_not = None if args.smoke else netns.available()
    links: list[tuple[str, Any]] = [("loopback", None)]
    if why_not is None and not args.smoke:
        links.append((f"veth {args.rate}", args.rate))
    elif why_not:
        print(f"rate-limited link skipped: {why_not}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, rate in links:
        runs[name] = {c: [] for c in cases}
        for r in range(args.rounds):
            jobs = progress(cases, len(cases), f"{name} round {r + 1}/{args.rounds}")
            for opt in jobs:  # alternating, so drift hits both
                if rate is None:
                    runs[name][opt].append(run_pair(args, opt, None))
                else:
                    with netns.linked_pair("cc", rate=rate) as link:
                        runs[name][opt].append(run_pair(args, opt, link))
    rows, summary = [], {}
    for name, by_opt in runs.items():
        s: dict[str, Any] = {}
        for opt, results in by_opt.items():
            steps = [t for r in results for t in r["step_s"]]
            s[opt] = {
                "median_step_s": median(steps),
                "wire_bytes_per_step": median([r["wire_bytes_per_step"] for r in results]),
                "final_loss": median([r["losses"][-1] for r in results]),
            }
        for case in cases:
            base = s[BASELINE[case]]
            if case == BASELINE[case]:
                continue
            s[case]["speedup"] = base["median_step_s"] / s[case]["median_step_s"]
            s[case]["bytes_ratio"] = base["wire_bytes_per_step"] / s[case]["wire_bytes_per_step"]
            s[case]["loss_ratio"] = s[case]["final_loss"] / base["final_loss"]
        summary[name] = s
        for case in cases:
            c = s[case]
            vs = (
                f" ({c['speedup']:.2f}x faster, {c['bytes_ratio']:.1f}x fewer bytes, loss "
                f"{c['loss_ratio']:.3f}x vs {BASELINE[case]})"
                if "speedup" in c
                else ""
            )
            rows.append(
                [
                    f"{name} {case}",
                    f"{c['median_step_s'] * 1e3:.0f}",
                    f"{c['wire_bytes_per_step'] / 2**20:.2f}",
                    f"{c['final_loss']:.5f}{vs}",
                ]
            )
    print_table(["case", "step ms", "wire MiB/step", "final loss"], rows)
    peer: dict[str, Any] | None = None
    if not (args.smoke or args.no_upstream) and upstream_python().exists():
        peer = upstream_peer()
        print(f"upstream 0.19.8 OnebitAdam on this machine (gloo, CPU): {peer}")
    params = runs["loopback"]["adam"][0]["params"]
    path = write_result(
        "compressed_comm",
        {
            "workload": {
                "model": f"MLP {args.layers} x Linear({args.width}, {args.width}) + Tanh",
                "params": params,
                "batch_per_rank": args.batch,
                "ranks": 2,
                "timed_steps": args.steps,
                "freeze_step": args.warmup,
                "cases": {c: CASES[c] for c in cases},
                "rounds": args.rounds,
                "rate_limited_link": None if why_not or args.smoke else args.rate,
                "why_no_limited_link": why_not,
            },
            "machine": machine_info(),
            "busy_warning": warn,
            "summary": summary,
            "upstream_onebit_adam": peer,
            "raw": runs,
        },
        smoke=args.smoke,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

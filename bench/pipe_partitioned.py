"""Pipeline p2p partitioned over the tensor ranks ([Note: partitioned p2p]) against whole
messages, on the link it is for: 2 "nodes" (network namespaces joined by a veth pair with a
tc rate limit, made here and removed after; needs root), each holding one pipeline stage of
2 tensor-parallel ranks, so activations and gradients cross the limited link and the tensor
groups talk inside their node. One job builds two engines on the same model and batches,
`pipeline.pipe_partitioned` / `grad_partitioned` on (upstream's default) and off, and times
their train_batch() steps alternately (drift hits both); median over the timed steps.

    python bench/pipe_partitioned.py                  # 1 Gbit/s between the nodes
    python bench/pipe_partitioned.py --rate 500mbit
    python bench/pipe_partitioned.py --smoke          # loopback only, small (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
from common import busy_warning, machine_info, median, print_table, write_result  # noqa: E402

TP = 2
WAYS = ("partitioned", "whole")


def _layers(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """Token embedding, residual MLP blocks (up column-, down row-parallel), a head: cut
    uniformly, stage 0 gets the embedding and half the blocks."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(args.vocab, args.d_model)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.tok(ids)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(args.d_model)
            self.up = nn.Linear(args.d_model, 4 * args.d_model)
            self.down = nn.Linear(4 * args.d_model, args.d_model)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.ln(x))))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(args.d_model)
            self.out = nn.Linear(args.d_model, args.vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.ln(x))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1))

    torch.manual_seed(0)
    return [Embed(), *[Block() for _ in range(args.blocks)], Head()], loss_fn


def _engine(args: argparse.Namespace, split: bool) -> Any:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed_ext.comm.topology import PipeModelDataParallelTopology

    layers, loss_fn = _layers(args)
    module = PipelineModule(
        layers,
        topology=PipeModelDataParallelTopology(num_pp=2, num_mp=TP, num_dp=1),
        loss_fn=loss_fn,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "pipeline": {"pipe_partitioned": split, "grad_partitioned": split},
        "tensor_parallel": {
            "autotp_size": TP,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
                    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
                ],
            },
        },
    }
    engine, *_ = deepspeed.initialize(model=module, config=config)
    return engine


def worker(args: argparse.Namespace) -> None:
    import torch

    from deepspeed_ext import comm

    torch.set_num_threads(1)
    comm.init_distributed(dist_backend="gloo")
    engines = {way: _engine(args, way == "partitioned") for way in WAYS}
    g = torch.Generator().manual_seed(1)
    shape = (args.micro_batch, args.seq)
    batch = [(torch.randint(0, args.vocab, shape, generator=g),) * 2]
    batch *= args.micro_batches
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    losses: dict[str, list[float]] = {way: [] for way in WAYS}
    comm.comms_logger.configure(enabled=True, prof_all=False, prof_ops=["isend"])
    sent = dict.fromkeys(WAYS, 0)
    for i in range(args.warmup + args.steps):
        for way, engine in engines.items():  # alternating
            comm.comms_logger.reset_data()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = engine.train_batch(iter(batch) if engine._needs_data() else None)
            torch.distributed.barrier()
            if i >= args.warmup:
                times[way].append(time.perf_counter() - t0)
                sent[way] += comm.comms_logger.total_bytes("isend")
            losses[way].append(float(loss))
    sent_all = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(sent_all, sent)
    if comm.get_rank() == 0:
        out = {"times": times, "losses": losses, "isend_bytes_per_rank": sent_all}
        Path(args.out).write_text(json.dumps(out))
    for engine in engines.values():
        engine.destroy()


def run(args: argparse.Namespace, link: netns.Link | None) -> dict[str, Any]:
    """Ranks 0, 1 (stage 0's tensor group) on one node, 2, 3 (stage 1's) on the other."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
        for key in ("micro_batch", "micro_batches", "seq", "d_model", "blocks", "vocab"):
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        procs = netns.start_ranks(link, TP, argv, 29800 + os.getpid() % 90)
        netns.wait_ranks(procs, timeout=900)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rate", default="1gbit", help="the inter-node link's tc rate")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.micro_batch, args.seq, args.d_model, args.steps = 2, 16, 32, 2
    warn = busy_warning()
    if warn:
        print(warn)
    why_not = None if args.smoke else netns.available()
    if why_not:
        print(f"rate-limited link unavailable ({why_not}): loopback only")
    if args.smoke or why_not:
        res, where = run(args, None), "loopback"
    else:
        with netns.linked_pair("pp", rate=args.rate, subnet="10.78.0") as link:
            res, where = run(args, link), f"veth {args.rate}"
    med = {way: median(res["times"][way]) for way in WAYS}
    if res["losses"]["partitioned"] != res["losses"]["whole"]:
        raise SystemExit(f"the two engines trained apart: {res['losses']}")
    sent = {way: sum(r[way] for r in res["isend_bytes_per_rank"]) / args.steps for way in WAYS}
    speedup = med["whole"] / med["partitioned"]
    rows = [
        [way, f"{med[way] * 1e3:.1f}", f"{sent[way] / 2**20:.2f}"]
        + ([f"{speedup:.2f}x"] if way == "partitioned" else ["1.00x"])
        for way in WAYS
    ]
    print_table(["p2p", "step ms", "MB sent per step (all ranks)", "speed-up"], rows)
    mb = args.micro_batch * args.seq * args.d_model * 4 / 2**20
    path = write_result(
        "pipe_partitioned",
        {
            "workload": {
                "nodes": 2,
                "layout": f"pipeline 2 x tensor {TP}, one stage per node",
                "link": where,
                "activation_mb_per_micro_batch": mb,
                "micro_batches": args.micro_batches,
                "blocks": args.blocks,
                "d_model": args.d_model,
                "timed_steps": args.steps,
                "why_no_limited_link": why_not,
            },
            "machine": machine_info(),
            "busy_warning": warn,
            "median_step_s": med,
            "isend_bytes_per_step": sent,
            "speedup": speedup,
            "byte_ratio": sent["partitioned"] / sent["whole"],
            "losses": res["losses"],
            "raw": res["times"],
        },
        smoke=args.smoke,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Benchmark worker: one rank of a 4-stage pipeline training job, for bench/pipeline_step.py.

    --impl ours      deepspeed_ext: deepspeed.pipe.PipelineModule + engine.train_batch (1F1B,
                     or --schedule zb-h1, or --chunks 2 interleaved, or --schedule
                     dualpipev --chunks 2, a DualPipeVModule); started by our launcher
                     (deepspeed --num_gpus 4 ...)
    --impl upstream  UPSTREAM DeepSpeed 0.19.8, the same PipelineModule code and config (its
                     venv's python, a cwd outside the repository, DS_ACCELERATOR=cpu)
    --impl torch     torch.distributed.pipelining: PipelineStage + Schedule1F1B over the same
                     layers, torch.optim.AdamW; torch.distributed.run

Workload (--mode real): a GPT of --n-layer blocks (examples/gpt.py's Block), token and
position embeddings as layer 0 and final norm + untied head as the last layer, cut into 4
stages by layer count ("uniform": every impl gets the same cut); micro-batch --micro-batch
sequences of --seq tokens, --micro-batches per step, fp32, AdamW lr 1e-3. --mode emulated:
each stage is one layer whose forward sleeps --emulate-ms and whose backward sleeps as long
for the input gradient and as long again for the weight gradient (compute of fixed duration
that does not compete for the 2 cores; a split backward pays each half in its own pass), so
the measured bubble is the schedule's own: 1 - m*(F+B+W)/step_time. The layer scales its
input by a parameter first, so that stage 0 has an input gradient to compute too.
Rank 0 times --steps steps after --warmup, each step from the last one's end (a step ends
on its collectives), and prints RESULT_TAG + JSON: step_s is the median step (step_s_mean
the mean over the barriers around them all).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULT_TAG = "PIPELINE_STEP_RESULT "
_spec = importlib.util.spec_from_file_location(
    "ddp_step_worker", Path(__file__).resolve().parent / "ddp_step_worker.py"
)
assert _spec is not None and _spec.loader is not None
ddw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ddw)  # stdlib-only at import time: its _isolate_from_repo
GPT_FILE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
STAGES = 4


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("ours", "upstream", "torch"), required=True)
    ap.add_argument("--mode", choices=("real", "emulated"), default="real")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=10)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--emulate-ms", type=float, default=20.0)
    ap.add_argument(
        "--chunks", type=int, default=1, help="ours only: model chunks per rank (interleaved)"
    )
    ap.add_argument(
        "--schedule",
        default="1f1b",
        help="pipeline.schedule (ours); dualpipev (ours and upstream): a DualPipeVModule, "
        "give --chunks 2",
    )
    ap.add_argument("--run-id", default="")
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


def _layers(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """The layer list and the loss function (module-level classes: every impl builds them)."""
    import torch
    from torch import nn

    if args.mode == "emulated":
        sleep = args.emulate_ms / 1000.0 / args.chunks  # the same compute per rank

        # Two custom functions joined by a built-in multiply, which autograd asks only for
        # the gradients a pass needs (a custom function's ctx.needs_input_grad is fixed at
        # forward time): the input side sleeps B, the weight side W.
        class SpinIn(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any) -> Any:
                time.sleep(sleep)
                return x.clone()

            @staticmethod
            def backward(ctx: Any, g: Any) -> Any:
                time.sleep(sleep)
                return g

        class SpinW(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, w: Any) -> Any:
                return w.clone()

            @staticmethod
            def backward(ctx: Any, g: Any) -> Any:
                time.sleep(sleep)
                return g

        class Spin(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(args.d_model))
                self.scale = nn.Parameter(torch.ones(args.d_model))

            def forward(self, x: Any) -> Any:
                return SpinIn.apply(x * self.scale) * SpinW.apply(self.w)

        spins = [Spin() for _ in range(STAGES * args.chunks)]
        return spins, lambda out, y: (out.float() ** 2).mean()

    spec = importlib.util.spec_from_file_location("pipeline_step_gpt", GPT_FILE)
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt
    spec.loader.exec_module(gpt)
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
    )

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

        def forward(self, idx: Any) -> Any:
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

        def forward(self, x: Any) -> Any:
            return self.head(self.ln(x))

    torch.manual_seed(0)
    layers = [Embed(), *[gpt.Block(cfg) for _ in range(cfg.n_layer)], Head()]

    def loss_fn(logits: Any, y: Any) -> Any:
        return nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))

    return layers, loss_fn


def _emulated_compute_ms(args: argparse.Namespace, layer: Any) -> float:
    """What one micro-batch's forward and backward take on one rank (its chunks' layers),
    timed in this process: the emulated compute's real length (a sleep overshoots, and the
    autograd calls around it cost a little), the ideal a bubble is measured against."""
    import torch

    times = []
    for _ in range(5):
        x = torch.randn(args.micro_batch, args.d_model)
        t0 = time.perf_counter()
        layer(x).sum().backward()
        times.append(time.perf_counter() - t0)
    layer.zero_grad(set_to_none=True)
    return sorted(times)[2] * 1000.0 * args.chunks


def _batches(args: argparse.Namespace) -> list[list[tuple[Any, Any]]]:
    import torch

    out = []
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(s)
        mbs = []
        for _ in range(args.micro_batches):
            if args.mode == "emulated":
                x = torch.randn(args.micro_batch, args.d_model, generator=g)
                mbs.append((x, x))
            else:
                tok = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
                mbs.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
        out.append(mbs)
    return out


def _ds_step(args: argparse.Namespace, layers: list[Any], loss_fn: Any) -> Any:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    v = args.schedule.startswith("dualpipev")  # dualpipev-zb: ours only
    if v and args.chunks != 2:
        raise SystemExit("--schedule dualpipev holds 2 stages per rank: give --chunks 2")
    extra = {"virtual_stages": args.chunks} if args.chunks > 1 and not v else {}
    cls = deepspeed.DualPipeVModule if v else PipelineModule
    module = cls(layers, num_stages=STAGES, loss_fn=loss_fn, partition_method="uniform", **extra)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if args.schedule not in ("1f1b", "dualpipev"):  # a DualPipeVModule picks its own
        config["pipeline"] = {"schedule": args.schedule}
    engine, *_ = deepspeed.initialize(model=module, config=config)

    def step(mbs: list[Any]) -> float:
        return float(engine.train_batch(iter(mbs)))

    return step


def _torch_step(args: argparse.Namespace, layers: list[Any], loss_fn: Any) -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = len(layers)
    chunk, extra = divmod(n, STAGES)  # the "uniform" cut of the deepspeed impls
    bounds = [0]
    for s in range(STAGES):
        bounds.append(bounds[-1] + chunk + (1 if s < extra else 0))
    stage_mod = torch.nn.Sequential(*layers[bounds[rank] : bounds[rank + 1]])
    stage = PipelineStage(stage_mod, rank, STAGES, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3)

    def step(mbs: list[Any]) -> float:
        x = torch.cat([a for a, _ in mbs])
        y = torch.cat([b for _, b in mbs])
        losses: list[Any] = []
        if rank == 0:
            sched.step(x)
        elif rank == STAGES - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return float(torch.stack(losses).detach().mean()) if losses else 0.0

    return step


def main() -> int:
    args = _parse()
    if args.impl == "upstream":
        ddw.use_upstream()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    layers, loss_fn = _layers(args)
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    compute_ms = _emulated_compute_ms(args, layers[0]) if args.mode == "emulated" else None
    data = _batches(args)
    step = (_torch_step if args.impl == "torch" else _ds_step)(args, layers, loss_fn)
    for mbs in data[: args.warmup]:
        step(mbs)
    dist.barrier()
    t0 = time.perf_counter()
    loss = 0.0
    marks = []
    for mbs in data[args.warmup :]:
        loss = step(mbs)  # ends on a collective (the loss, the optimizer step): in step
        marks.append(time.perf_counter())
    dist.barrier()
    mean = (time.perf_counter() - t0) / args.steps
    # the median step: one slow step (a neighbour's burst on the shared cores) moves a mean
    # of a few steps by more than the engines differ
    per_step = [b - a for a, b in zip([t0, *marks[:-1]], marks)]
    dt = sorted(per_step)[len(per_step) // 2]
    if dist.get_rank() == 0:
        result = {
            "impl": args.impl,
            "mode": args.mode,
            "micro_batches": args.micro_batches,
            "chunks": args.chunks,
            "schedule": args.schedule,
            "params": params,
            "step_s": dt,
            "step_s_mean": mean,
            "step_s_each": per_step,
            "steps_per_s": 1.0 / dt,
            "last_loss_rank0": loss,
            "threads": torch.get_num_threads(),
            "compute_ms_per_micro_batch": compute_ms,
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

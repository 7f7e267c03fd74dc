"""The main job: train a small GPT on a generated corpus with DeepSpeed data parallelism.

    python examples/train_tiny_gpt.py              # 2 CPU ranks (every GPU where present)
    deepspeed --num_gpus 2 examples/train_tiny_gpt.py --steps 200
    python examples/train_tiny_gpt.py --onebit-freeze 100       # 1-bit Adam after 100 steps
    python examples/train_tiny_gpt.py --flops-profile-step 10   # a FLOPs profile of step 10

Run plainly, it relaunches itself through the `deepspeed` launcher. Each rank trains on its
own shard of micro-batches; the engine averages gradients across ranks, steps DeepSpeedCPUAdam
(FusedAdam on GPUs), follows a WarmupDecayLR schedule, and prints a metrics line every
`steps_per_print` steps. Every rank evaluates on held-out text (ZeRO 3 gathers parameters
from all ranks in a forward); rank 0 reports, and a checkpoint (atomic: temp dir, fsync,
rename) and a loss-curve PNG are written.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CharData, generate  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed_ext.monitor.report import loss_plot  # noqa: E402


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": args.print_every,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": max(1, args.steps // 20),
                "warmup_type": "linear",
                "total_num_steps": args.steps,
            },
        },
        "bf16": {"enabled": args.bf16},
        "zero_optimization": {"stage": args.zero_stage},
        # the metrics as JSON lines: `ds_report run <out>` summarizes and plots them
        "jsonl_monitor": {"enabled": True, "output_path": args.out, "job_name": "metrics"},
        **extras(args),
    }


def extras(args: argparse.Namespace) -> dict:
    out: dict = {}
    if args.onebit_freeze:
        out["optimizer"] = {
            "type": "OneBitAdam",
            "params": {"lr": args.lr, "weight_decay": 0.01, "freeze_step": args.onebit_freeze},
        }
    if args.flops_profile_step:
        out["flops_profiler"] = {
            "enabled": True,
            "profile_step": args.flops_profile_step,
            "module_depth": 2,
            "detailed": False,
        }
    return out


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: CharData, device: torch.device, batches: int = 8
) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        x, y = data.batch(32, gen)
        losses.append(float(model(x.to(device), y.to(device))))
    model.train()
    return sum(losses) / len(losses)


def relaunch_under_launcher() -> None:
    """`python train_tiny_gpt.py` -> `deepspeed --num_gpus N train_tiny_gpt.py ...`."""
    from deepspeed_ext.launcher.runner import main as launcher_main

    n = torch.cuda.device_count() if torch.cuda.is_available() else 2
    sys.exit(launcher_main(["--num_gpus", str(n), __file__, *sys.argv[1:]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument(
        "--onebit-freeze",
        type=int,
        default=0,
        help="train with 1-bit Adam, AdamW for this many warm-up steps (stage 0 only)",
    )
    ap.add_argument(
        "--flops-profile-step", type=int, default=0, help="print a FLOPs profile of this step"
    )
    ap.add_argument("--print-every", type=int, default=25)
    ap.add_argument("--out", default="examples/out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        relaunch_under_launcher()

    torch.manual_seed(args.seed)
    text = generate()
    split = int(0.9 * len(text))
    cfg = GPTConfig()
    train = CharData(text[:split], cfg.seq_len)
    val = CharData(text[split:], cfg.seq_len, vocab=train.chars)
    cfg.vocab_size = train.vocab_size
    engine, _, _, _ = deepspeed.initialize(model=GPT(cfg), config=ds_config(args))
    rank, world = engine.rank, engine.world_size
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if rank == 0:
        print(
            f"GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {n_params / 1e6:.2f}M params; "
            f"{world} ranks x micro-batch {args.micro_batch} x accumulation {args.grad_accum} = "
            f"{engine.train_batch_size()} samples/step; corpus {len(text) / 1e3:.0f}K chars",
            flush=True,
        )
    # every rank evaluates: with ZeRO 3 a forward gathers parameters from all ranks
    first_eval = evaluate(engine.module, val, engine.device)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # each rank its own shard
    losses: list[float] = []
    t0 = time.perf_counter()
    while engine.global_steps < args.steps:
        x, y = train.batch(args.micro_batch, gen)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if engine.is_gradient_accumulation_boundary() or args.grad_accum == 1:
            losses.append(float(loss.detach()))

    out = Path(args.out)
    engine.save_checkpoint(str(out / "checkpoints"), client_state={"seed": args.seed})
    final_eval = evaluate(engine.module, val, engine.device)
    if rank == 0:
        try:
            plot = f"loss curve {loss_plot(out / 'loss.png', losses, 'tiny GPT: training loss')}"
        except ImportError:
            plot = "no loss curve (matplotlib is not installed: pip install matplotlib)"
        print(
            f"done in {time.perf_counter() - t0:.0f} s: held-out loss {first_eval:.3f} -> "
            f"{final_eval:.3f} (uniform guess {math.log(cfg.vocab_size):.3f}); checkpoint in "
            f"{out / 'checkpoints'}, {plot}; the run's report: ds_report run {out}",
            flush=True,
        )
        if not final_eval < 0.6 * first_eval:
            sys.exit("the held-out loss did not fall clearly: something is wrong")


if __name__ == "__main__":
    main()

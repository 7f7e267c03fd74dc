"""Pipeline parallelism: the tiny GPT cut into stages, trained with the 1F1B schedule.

    python examples/train_pipeline.py                  # 2 CPU ranks = 2 stages
    deepspeed --num_gpus 4 examples/train_pipeline.py --stages 2   # 2 stages x 2 data ranks

The model is a list of layers: the token embedding as a TiedLayerSpec (its weight is used
again by the output head on the last stage: the tie spans stages, its gradients are summed
between them), the transformer blocks as LayerSpecs (each stage builds only its own), a final
norm, and the tied head. `engine.train_batch()` pulls gradient_accumulation_steps
micro-batches per step from the first and last stages' data iterator; the loss it returns is
the same on every rank. A checkpoint in upstream's per-layer layout is written at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CharData, generate  # noqa: E402
from gpt import Block, GPTConfig  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402


class Embedding(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c.vocab_size, c.d_model) * 0.02)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.d_model))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight) + self.pos[: idx.shape[1]]


def lm_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()  # the tied output projection


def make_loss(vocab: int) -> Any:
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4, help="per step, per data rank")
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument(
        "--dualpipev",
        action="store_true",
        help="DualPipeV: 2 stages per rank as a V (needs --micro-batches >= 2 x --stages)",
    )
    ap.add_argument("--out", default="examples/out/pipeline")
    ap.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # run plainly: relaunch through the launcher
        from deepspeed_ext.launcher.runner import main as launcher_main

        sys.exit(launcher_main(["--num_gpus", str(args.stages), __file__, *sys.argv[1:]]))

    text = generate()
    cfg = GPTConfig()
    data = CharData(text, cfg.seq_len)
    cfg.vocab_size = data.vocab_size
    layers = [
        TiedLayerSpec("embed", Embedding, cfg),
        *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.d_model),
        TiedLayerSpec("embed", Embedding, cfg, forward_fn=lm_head),
    ]
    model = (DualPipeVModule if args.dualpipev else PipelineModule)(
        layers, num_stages=args.stages, loss_fn=make_loss(cfg.vocab_size), seed_layers=True
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "gradient_clipping": 1.0,
        "steps_per_print": 20,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1000 + engine.dp_rank)  # each data rank its own data

    def batches() -> Any:
        while True:
            yield data.batch(args.micro_batch, gen)

    it = batches()
    first = last = 0.0
    for step in range(args.steps):
        loss = float(engine.train_batch(it))
        first = loss if step == 0 else first
        last = loss
    engine.save_checkpoint(args.out)
    if engine.rank == 0:
        print(
            f"pipeline of {engine.num_stages} stages x {engine.dp_world_size} data ranks, "
            f"parts {engine.module.parts}: loss {first:.3f} -> {last:.3f}; checkpoint in {args.out}"
        )


if __name__ == "__main__":
    main()

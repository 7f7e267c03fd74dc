"""Mixture of experts: the tiny GPT with each block's MLP an MoE layer, experts spread over ranks.

    python examples/train_moe.py                       # 2 CPU ranks, ep_size 2
    deepspeed --num_gpus 4 examples/train_moe.py --ep-size 2   # each expert on 2 ranks
    deepspeed --num_gpus 4 examples/train_moe.py --ep-size 2 --zero-stage 2  # ... partitioned

Each block's feed-forward is `deepspeed.moe.layer.MoE` with `--experts` experts and top-2
gating; with `--ep-size` E each rank holds experts/E of them and tokens travel to their
experts' ranks by all-to-all. The auxiliary load-balancing loss is added to the language-model
loss. At the end a checkpoint is written (each expert in upstream's per-expert files) and
consolidated with zero_to_fp32 into the state dict of the same model with every expert local.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import CharData, generate  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402


class MoEMLP(nn.Module):
    """A block's MLP as an MoE layer; keeps its auxiliary loss for the training loss."""

    def __init__(self, c: GPTConfig, experts: int, ep_size: int) -> None:
        super().__init__()
        expert = nn.Sequential(
            nn.Linear(c.d_model, 2 * c.d_model), nn.GELU(), nn.Linear(2 * c.d_model, c.d_model)
        )
        self.moe = MoE(
            c.d_model,
            expert,
            num_experts=experts,
            ep_size=ep_size,
            k=2,
            capacity_factor=1.25,
            min_capacity=4,
        )
        self.l_aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


def build(c: GPTConfig, experts: int, ep_size: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(c)
    for blk in model.blocks:
        blk.mlp = MoEMLP(c, experts, ep_size)  # type: ignore[assignment]
    return model


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    lm = model(x, y)
    aux = sum(blk.mlp.l_aux for blk in model.module.blocks)
    return lm + 0.01 * aux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ep-size", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2))
    ap.add_argument("--out", default="examples/out/moe")
    ap.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # run plainly: relaunch through the launcher
        from deepspeed_ext.launcher.runner import main as launcher_main

        sys.exit(launcher_main(["--num_gpus", str(args.ep_size), __file__, *sys.argv[1:]]))

    text = generate()
    cfg = GPTConfig(n_layer=2)
    split = int(0.9 * len(text))
    data = CharData(text[:split], cfg.seq_len)
    val = CharData(text[split:], cfg.seq_len, vocab=data.chars)
    cfg.vocab_size = data.vocab_size
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 20,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.zero_stage},
    }
    engine, *_ = deepspeed.initialize(model=build(cfg, args.experts, args.ep_size), config=config)
    gen = torch.Generator().manual_seed(1000 + engine.dp_rank)  # each data rank its own data
    held_out = val.batch(32, torch.Generator().manual_seed(7))

    def evaluate() -> float:
        engine.eval()
        with torch.no_grad():
            loss = float(engine(*held_out))
        engine.train()
        return loss

    first = evaluate()
    for _ in range(args.steps):
        loss = loss_of(engine, *data.batch(args.micro_batch, gen))
        engine.backward(loss)
        engine.step()
    last = evaluate()
    engine.save_checkpoint(args.out, tag="final")
    if engine.rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        whole = get_fp32_state_dict_from_zero_checkpoint(args.out, tag="final")
        local = build(cfg, args.experts, 1).state_dict()
        assert whole.keys() == local.keys(), "the consolidated model is not the ep_size-1 one"
        print(
            f"MoE GPT, {args.experts} experts a block over ep_size {args.ep_size} "
            f"({engine.dp_world_size} ranks, ZeRO stage {args.zero_stage}): "
            f"held-out loss {first:.3f} -> {last:.3f}; "
            f"checkpoint in {args.out}, consolidated to {len(whole)} tensors"
        )


if __name__ == "__main__":
    main()

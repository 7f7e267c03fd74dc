"""One rank of bench/tp_step.py: a Hugging Face Llama built from a config (random weights,
seed 0) trained by `deepspeed` (ours, or upstream's in its venv) with tensor slicing
(tensor_parallel.autotp_size = --tp) or without (--tp 1: data parallel), ZeRO --stage,
torch AdamW as the client optimizer (no op build in the timing), fp32, random tokens.

Started by torch.distributed.run (2 ranks, gloo, OMP_NUM_THREADS=1). Rank 0 times --steps
steps after --warmup between barriers and prints RESULT_TAG + JSON: the step time, and per
rank the steady peak resident memory (VmHWM reset through /proc/self/clear_refs after the
warmup), the base resident memory before the model, and the bytes of the parameters it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULT_TAG = "TP_STEP_RESULT "


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k == key:
            return int(v.split()[0])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("ours", "upstream"), required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import deepspeed

    base_kb = status_kb("VmRSS")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    config: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = rank // args.tp  # tensor ranks are consecutive (both implementations)
    held = sum(p.numel() * p.element_size() for p in engine.module.parameters())

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        return torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g)

    def step(i: int) -> float:
        ids = batch(i)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    for i in range(args.warmup):
        step(i)
    Path("/proc/self/clear_refs").write_text("5")
    dist.barrier()
    t0 = time.perf_counter()
    loss = 0.0
    for i in range(args.warmup, args.warmup + args.steps):
        loss = step(i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    mine = {
        "peak_mb": status_kb("VmHWM") / 1024,
        "base_mb": base_kb / 1024,
        "held_mb": held / 2**20,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        out = {
            "impl": args.impl,
            "tp": args.tp,
            "stage": args.stage,
            "world": world,
            "params": n_params,
            "step_s": elapsed / args.steps,
            "final_loss": loss,
            "ranks": everyone,
            "deepspeed": f"{deepspeed.__version__} from {os.path.dirname(deepspeed.__file__)}",
            "torch": torch.__version__,
        }
        print(RESULT_TAG + json.dumps(out), flush=True)
    engine.destroy() if hasattr(engine, "destroy") else None
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a small ZeRO job for bench/exit_soak.py: a few training steps, then a normal
return from the script (so the interpreter's own exit path runs, as in a user's job)."""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher passes it
    args = ap.parse_args()
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    zero: dict = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for _ in range(5):
        loss = engine(torch.randn(4, 256)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print("EXIT_WORKER_DONE", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)

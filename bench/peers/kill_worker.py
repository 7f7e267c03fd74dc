"""One rank of a small ZeRO job for bench/kill_soak.py: trains and saves a checkpoint after
every step, saying where it is on stdout (PID, STEP n, SAVE n, SAVED n) so the soak can kill
it at a chosen moment. --verify instead loads the directory's `latest` in a world of one and
says which tag it found (the checkpoint must load at another world size)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

WIDTH = 1024  # 8 layers: ~100 MB per checkpoint with Adam states, a save of a few 0.1 s


def _engine(stage: int) -> object:
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def say(line: str) -> None:
    """One write per line: both ranks share the launcher's stdout, and under `python -u` (how
    the launcher starts ranks) print() writes the text and its newline apart, so another
    rank's line can land between them ('SAVED 2STALL', which a soak waiting for 'STALL' missed)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--stall_rank", type=int, default=-1, help="this rank sleeps before step 3")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher passes it
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    say(f"PID {os.getpid()} RANK {rank}")
    engine = _engine(args.stage)
    if args.verify:
        path, _ = engine.load_checkpoint(args.ckpt)  # type: ignore[attr-defined]
        say(f"LOADED {path} step {engine.global_steps}")  # type: ignore[attr-defined]
        return
    for step in range(1, args.steps + 1):
        if step == 3 and rank == args.stall_rank:
            say("STALL")  # the other rank waits in the step's collective
            time.sleep(3600)
        say(f"STEP {step}")
        loss = engine(torch.randn(4, WIDTH)).pow(2).mean()  # type: ignore[operator]
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        say(f"SAVE {step}")
        engine.save_checkpoint(args.ckpt, tag=f"step{step}")  # type: ignore[attr-defined]
        say(f"SAVED {step}")


if __name__ == "__main__":
    main()
    sys.exit(0)

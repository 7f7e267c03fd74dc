"""A plain PyTorch loop under Hugging Face Accelerate with its DeepSpeedPlugin (ZeRO 2 here),
unmodified, on this package: the same tiny GPT-2 and data as hf_trainer.py.

    python examples/hf_accelerate.py    # 2 CPU ranks through the `deepspeed` launcher

Accelerate turns the plugin into a DeepSpeed config ("auto" batch sizes filled from the
DataLoader), hands model, optimizer and scheduler to deepspeed.initialize, and from then on
accelerator.backward runs the engine's backward and step. Rank 0 prints the per-step losses as
JSON, saves the training state (the engine's checkpoint) and the full weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer import cpu_only_accelerate_state, dataset, relaunch_under_launcher, tiny_gpt2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--out", default="examples/out/hf_accelerate")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        relaunch_under_launcher(__file__)

    from accelerate import Accelerator, DeepSpeedPlugin
    from transformers import get_linear_schedule_with_warmup

    if not torch.cuda.is_available():
        cpu_only_accelerate_state()
    plugin = DeepSpeedPlugin(
        zero_stage=args.zero_stage, gradient_accumulation_steps=args.grad_accum
    )
    accelerator = Accelerator(deepspeed_plugin=plugin)
    world = accelerator.num_processes
    data = dataset(args.micro_batch * args.grad_accum * world * args.steps)
    loader = torch.utils.data.DataLoader(data, batch_size=args.micro_batch, shuffle=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = get_linear_schedule_with_warmup(optimizer, 2, args.steps)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

    losses: list[float] = []
    norms: list[float] = []
    window: list[torch.Tensor] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)  # the engine's backward, and its step on a boundary
            window.append(loss.detach())
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                mean = accelerator.gather(torch.stack(window).mean()).mean()
                losses.append(float(mean))
                window = []
            optimizer.step()  # no-ops under DeepSpeed: the engine stepped in backward
            schedule.step()
            optimizer.zero_grad()

    out = Path(args.out)
    accelerator.save_state(str(out / "state"))  # the engine's checkpoint, every rank
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out / "final", state_dict=weights)
        print("LOSSES " + json.dumps(losses), flush=True)
        print("GRAD_NORMS " + json.dumps(norms), flush=True)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps", flush=True)
        if not losses[-1] < losses[0]:
            sys.exit("the training loss did not fall: something is wrong")
    accelerator.end_training()  # the process group down before the interpreter exits


if __name__ == "__main__":
    main()

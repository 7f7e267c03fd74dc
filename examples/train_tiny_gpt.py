"""The main job: train a small GPT on a generated corpus with DeepSpeedCPUAdam.

    python examples/train_tiny_gpt.py [--steps 400] [--out examples/out]

Prints a metrics line every --print-every steps, evaluates on held-out text, saves a
checkpoint (written to a temporary file, fsynced, renamed into place) and a loss-curve PNG.
The DeepSpeed engine (data parallel ranks, mixed precision, `deepspeed` launcher) replaces
the hand-written loop here once it lands; the optimizer step already runs on our SIMD op.
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

from deepspeed_ext.accelerator import get_accelerator  # noqa: E402
from deepspeed_ext.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from deepspeed_ext.utils.png_plot import line_plot  # noqa: E402


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: GPT, data: CharData, batches: int = 8) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [float(model(*data.batch(32, gen))) for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def save_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--print-every", type=int, default=25)
    ap.add_argument("--out", default="examples/out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    text = generate()
    split = int(0.9 * len(text))
    cfg = GPTConfig()
    train, val = CharData(text[:split], cfg.seq_len), CharData(text[split:], cfg.seq_len)
    val.stoi, val.chars = train.stoi, train.chars  # one vocabulary
    val.data = torch.tensor([train.stoi[c] for c in text[split:]], dtype=torch.long)
    cfg.vocab_size = train.vocab_size
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    acc = get_accelerator()
    print(
        f"model: GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {n_params / 1e6:.2f}M params; "
        f"corpus {len(text) / 1e3:.0f}K chars, vocab {cfg.vocab_size}; device {acc.device_name()}"
    )
    gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    t0, window_start = time.perf_counter(), time.perf_counter()
    first_eval = evaluate(model, val)
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 20))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = train.batch(args.batch_size, gen)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if (step + 1) % args.print_every == 0 or step + 1 == args.steps:
            dt = time.perf_counter() - window_start
            k = (
                args.print_every
                if (step + 1) % args.print_every == 0
                else (step + 1) % args.print_every
            )
            samples = k * args.batch_size
            print(
                f"step {step + 1:>5} | loss {sum(losses[-k:]) / k:.4f} | lr {lr:.2e} | "
                f"samples/s {samples / dt:.1f} | tokens/s {samples * cfg.seq_len / dt:.0f} | "
                f"peak mem {acc.max_memory_allocated() / 2**20:.0f} MiB",
                flush=True,
            )
            window_start = time.perf_counter()
    final_eval = evaluate(model, val)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_atomic(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": args.steps,
            "config": vars(cfg),
        },
        out / "checkpoint.pt",
    )
    smooth = [
        sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
        for i in range(len(losses))
    ]
    line_plot(str(out / "loss.png"), [losses, smooth])
    print(
        f"done in {time.perf_counter() - t0:.0f} s: held-out loss {first_eval:.3f} -> "
        f"{final_eval:.3f} (uniform guess: {math.log(cfg.vocab_size):.3f}); "
        f"wrote {out / 'checkpoint.pt'} and {out / 'loss.png'}"
    )
    if not final_eval < 0.6 * first_eval:
        sys.exit("the held-out loss did not fall clearly: something is wrong")


if __name__ == "__main__":
    main()

"""One process of bench/activation_checkpointing.py: a 12-layer GPT's forward + backward
under each activation-checkpointing variant of one implementation, alternated in rounds.

  --impl ours      deepspeed.checkpointing of this project, and torch.utils.checkpoint
  --impl upstream  upstream DeepSpeed's deepspeed.checkpointing (run from its own venv)

Per variant: the memory held for the backward at the end of the forward (resident set after
the forward above before it; the parent fixes glibc's mmap threshold so freed tensors leave
the resident set, the same for every implementation), the peak resident memory over the
step above the memory before it (VmHWM reset through /proc/self/clear_refs), the bytes
autograd's saved-tensor hooks see (exact, but blind to tensors an implementation keeps
outside autograd's saved tensors, as upstream's reentrant checkpoint does), and step times.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpt_module() -> Any:
    # by path, so upstream's run never imports this repository's `deepspeed` package
    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpt"] = mod
    spec.loader.exec_module(mod)
    return mod


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _variants(impl: str) -> dict[str, Callable[[Any, list, Any], Any]]:
    """name -> how the blocks run: f(blocks, x) -> x."""

    def plain(blocks: Any, x: Any) -> Any:
        for b in blocks:
            x = b(x)
        return x

    def every(n: int, ckpt: Callable[..., Any]) -> Callable[[Any, Any], Any]:
        def run(blocks: Any, x: Any) -> Any:
            for i in range(0, len(blocks), n):
                group = blocks[i : i + n]

                def seg(y: Any, group: Any = group) -> Any:
                    for b in group:
                        y = b(y)
                    return y

                x = ckpt(seg, x)
            return x

        return run

    def first_of(k: int, m: int, ckpt: Callable[..., Any]) -> Callable[[Any, Any], Any]:
        """Of every m blocks, checkpoint the first k and keep the rest's activations
        (Megatron's block method): less recompute, less memory cut."""

        def run(blocks: Any, x: Any) -> Any:
            for i, b in enumerate(blocks):
                x = ckpt(b, x) if i % m < k else b(x)
            return x

        return run

    out: dict[str, Any] = {"none": plain}
    if impl == "ours":
        from torch.utils.checkpoint import checkpoint as tc

        import deepspeed

        ds = deepspeed.checkpointing
        out["ours full"] = every(1, ds.checkpoint)
        out["ours every-2"] = every(2, ds.checkpoint)
        out["ours non-reentrant"] = every(1, ds.non_reentrant_checkpoint)
        out["torch full"] = every(1, lambda f, x: tc(f, x, use_reentrant=False))
        out["torch every-2"] = every(2, lambda f, x: tc(f, x, use_reentrant=False))
        out["torch reentrant"] = every(1, lambda f, x: tc(f, x, use_reentrant=True))
        out["ours 3-of-4"] = first_of(3, 4, ds.checkpoint)
        out["ours 3-of-4 non-reentrant"] = first_of(3, 4, ds.non_reentrant_checkpoint)
        out["torch 3-of-4"] = first_of(3, 4, lambda f, x: tc(f, x, use_reentrant=False))
        out["torch 3-of-4 reentrant"] = first_of(3, 4, lambda f, x: tc(f, x, use_reentrant=True))
    else:
        import deepspeed

        ds = deepspeed.checkpointing
        out["upstream full"] = every(1, ds.checkpoint)
        out["upstream every-2"] = every(2, ds.checkpoint)
        out["upstream non-reentrant"] = every(1, ds.non_reentrant_checkpoint)
        out["upstream 3-of-4"] = first_of(3, 4, ds.checkpoint)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("ours", "upstream"), required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)  # upstream asks ranks
    if args.impl == "upstream":
        import deepspeed

        deepspeed.init_distributed("gloo")  # its comm layer must know the group
        deepspeed.checkpointing.configure(None)  # its globals are set only here

    gpt = _gpt_module()
    cfg = gpt.GPTConfig(
        vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=8, d_model=args.d_model
    )
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    variants = _variants(args.impl)

    def loss_of(run: Any) -> Any:
        t = idx.shape[1]
        x = model.tok(idx) + model.pos(torch.arange(t))
        x = run(model.blocks, x)
        logits = model.head(model.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, 256), idx.view(-1))

    def step(run: Any) -> None:
        model.zero_grad(set_to_none=True)
        loss_of(run).backward()

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes(run: Any) -> int:
        """Activations only: parameters autograd saves are not counted."""
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in weights:
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(run)
        del loss
        return sum(seen.values())

    times: dict[str, list[float]] = {n: [] for n in variants}
    peaks: dict[str, list[int]] = {n: [] for n in variants}
    held: dict[str, list[int]] = {n: [] for n in variants}
    saved: dict[str, int] = {}
    for r in range(args.rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            run = variants[name]
            step(run)  # warm-up
            model.zero_grad(set_to_none=True)
            before = _kb("VmRSS")
            _reset_peak()
            loss = loss_of(run)
            held[name].append(max(0, _kb("VmRSS") - before) * 1024)
            loss.backward()
            del loss
            peaks[name].append(max(0, _kb("VmHWM") - before) * 1024)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(run)
                times[name].append(time.perf_counter() - t0)
            if name not in saved:
                saved[name] = saved_bytes(run)
    out = {
        "impl": args.impl,
        "saved_bytes": saved,
        "peak_bytes": {n: statistics.median(v) for n, v in peaks.items()},
        "held_bytes": {n: statistics.median(v) for n, v in held.items()},
        "step_s": {n: statistics.median(v) for n, v in times.items()},
        "raw_step_s": times,
    }
    print("AC_RESULT " + json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Benchmark: DeepSpeedTransformerLayer (fused kernels) against the same BERT layer in torch
eager ops and torch.compile'd, same weights, forward + backward, on the CPU (a GPU when one is
present: bf16 there).

Workload: one encoder layer, hidden 768, 12 heads, intermediate 3072 (BERT-base), batch 8,
sequence 128, fp32, dropout 0.1 on attention and hidden states, an HF-style key-padding mask.
The implementations alternate in rounds (order flipped every round); median seconds per
forward + backward. Goal (the issue): the CPU layer no slower than eager (ratio <= 1.0);
>= 1.2x eager on a GPU.

On a GPU each round times --iters steps between synchronizations (the CPU queues work ahead,
as in training), and the result gives the fraction of GEMM peak: the layer's GEMM FLOPs per
second over a plain bf16 matmul's, measured in the same run. --profile prints each
implementation's top kernels (torch.profiler) after the timings.

    python bench/transformer_layer.py            # -> bench/results/transformer_layer.json
    python bench/transformer_layer.py --smoke    # tiny sizes, eager only
    python bench/transformer_layer.py --hidden 1024 --heads 16 --batch 64 --out F.json  # BERT-large
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import busy_warning, machine_info, median, print_table, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deepspeed_ext.ops.transformer import (  # noqa: E402
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=0, help="steps per round (0: 1 on CPU, 20 GPU)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--profile", action="store_true", help="print each one's top kernels")
    ap.add_argument("--out", type=Path, help="result file (default bench/results/...)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.batch, args.seq, args.rounds = 64, 4, 2, 16, 2
        args.no_compile = True
    return args


def eager_layer(p: dict[str, torch.Tensor], x, mask, heads: int, drop: float, eps: float):
    """The BERT pre-LN layer in plain torch ops (torch's own dropout)."""
    b, s, h = x.shape
    d = h // heads
    a_in = F.layer_norm(x, (h,), p["norm_w"], p["norm_b"], eps)
    q, k, v = (
        F.linear(a_in, p["attn_qkvw"], p["attn_qkvb"])
        .view(b, s, 3, heads, d)
        .permute(2, 0, 3, 1, 4)
        .unbind(0)
    )
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, -1)
    ctx = (F.dropout(probs, drop) @ v).transpose(1, 2).reshape(b, s, h)
    res = x + F.dropout(F.linear(ctx, p["attn_ow"], p["attn_ob"]), drop)
    ff = F.layer_norm(res, (h,), p["attn_nw"], p["attn_nb"], eps)
    inter = F.gelu(F.linear(ff, p["inter_w"], p["inter_b"]), approximate="tanh")
    return res + F.dropout(F.linear(inter, p["output_w"], p["output_b"]), drop)


def gemm_flops(b: int, s: int, h: int, inter: int) -> float:
    """FLOPs of the layer's matrix products, forward + backward (backward = 2x forward):
    qkv, attention output, the two feed-forward GEMMs, and scores / context per head."""
    t = b * s
    fwd = 2 * t * h * (3 * h + h + 2 * inter) + 2 * 2 * b * s * s * h
    return 3.0 * fwd


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of one large square matmul (the GEMM roof this machine reaches through torch)."""
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def profile(impls: dict[str, Any], device: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    for name, fn in impls.items():
        with torch_profile(activities=acts) as prof:
            for _ in range(5):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
        print(f"--- {name}: 5 steps")
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def main() -> int:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    iters = args.iters or (20 if device == "cuda" else 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = DeepSpeedTransformerConfig(
        batch_size=args.batch,
        hidden_size=args.hidden,
        heads=args.heads,
        attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1,
        num_hidden_layers=12,
        initializer_range=0.02,
        seed=0,
    )
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(cfg).to(device, dtype)
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=dtype)
    mask = torch.zeros(args.batch, 1, 1, args.seq, device=device, dtype=dtype)
    mask[: args.batch // 2, ..., -args.seq // 4 :] = -10000.0
    grad = torch.randn_like(x)

    def eager(fn):
        def step():
            xi = x.clone().requires_grad_()
            fn(params, xi, mask, args.heads, 0.1, cfg.layer_norm_eps).backward(grad)

        return step

    def fused():
        xi = x.clone().requires_grad_()
        layer(xi, mask).backward(grad)

    impls: dict[str, Any] = {"deepspeed_ext fused layer": fused, "torch eager": eager(eager_layer)}
    if not args.no_compile:
        t0 = time.perf_counter()
        compiled = eager(torch.compile(eager_layer))
        compiled()  # compile outside the timing
        print(f"torch.compile took {time.perf_counter() - t0:.0f} s", flush=True)
        impls["torch.compile"] = compiled
    for fn in impls.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(args.rounds):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        for name in order:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                impls[name]()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / iters)
    med = {k: median(v) for k, v in times.items()}
    eager_s = med["torch eager"]
    flops = gemm_flops(args.batch, args.seq, args.hidden, 4 * args.hidden)
    peak = matmul_peak(device, dtype) if device == "cuda" else None
    headers = ["implementation", "median ms", "time vs eager"]
    rows = [[k, f"{v * 1e3:.2f}", f"{v / eager_s:.3f}"] for k, v in med.items()]
    if peak:
        headers.append("of GEMM peak")
        for row, v in zip(rows, med.values()):
            row.append(f"{flops / v / peak:.1%}")
    print(
        f"BERT layer hidden {args.hidden}, {args.heads} heads, batch {args.batch} x seq "
        f"{args.seq}, {dtype}, {device}; median of {args.rounds} rounds of {iters} fwd+bwd"
        + (f"; GEMM peak (8192^3 matmul) {peak / 1e12:.0f} TFLOP/s" if peak else "")
    )
    print_table(headers, rows)
    warn = busy_warning()
    if warn:
        print(warn)
    payload = {
        "benchmark": "transformer_layer",
        "workload": {k: getattr(args, k) for k in ("hidden", "heads", "batch", "seq")}
        | {
            "dtype": str(dtype),
            "dropout": 0.1,
            "rounds": args.rounds,
            "steps_per_round": iters,
            "smoke": args.smoke,
        },
        "machine": machine_info(device),
        "raw_s": times,
        "median_s": med,
        "time_vs_eager": {k: v / eager_s for k, v in med.items()},
        "gemm_flops_per_step": flops,
        "gemm_peak_flops": peak,
        "fraction_of_gemm_peak": {k: flops / v / peak for k, v in med.items()} if peak else None,
        "goal": "fused <= 1.0x eager time on CPU; <= 1/1.2 on a GPU",
    }
    print(f"wrote {write_result('transformer_layer', payload, args.smoke, args.out)}")
    if args.profile:
        profile(impls, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

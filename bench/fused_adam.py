"""Benchmark: our FusedAdam against torch.optim.AdamW(fused=True) on one GPU.

Workload: ~1B fp32 params over ~300 tensors of mixed sizes, one optimizer step timed with
CUDA events, the two optimizers alternating (order flipped every repetition so neither
always runs on a warmer cache), median over repetitions. The same process measures the
device's copy bandwidth (a large tensor copy, read + write) and reports each optimizer's
effective bandwidth at 28 bytes/param (read p, g, m, v; write p, m, v) as a fraction of it.

    python bench/fused_adam.py            # full run, writes bench/results/fused_adam.json
    python bench/fused_adam.py --smoke    # tiny sizes, writes bench/results/fused_adam_smoke.json

Without a CUDA GPU it prints "needs a CUDA GPU; skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, machine_info, result_path, write_result

BYTES_PER_PARAM = 28  # fp32 Adam: 4 streams read, 3 written, 4 bytes each


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few repetitions")
    ap.add_argument("--params", type=int, default=1_000_000_000, help="total parameters")
    ap.add_argument("--tensors", type=int, default=300, help="number of param tensors")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per optimizer")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth copy")
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.tensors, args.reps, args.warmup, args.copy_gib = 2_000_000, 30, 3, 1, 0.05
    if args.out is None:
        args.out = result_path("fused_adam", args.smoke)
    return args


def tensor_sizes(total: int, count: int) -> list[int]:
    """Deterministic mixed sizes (log-spread over ~3 decades, like a transformer's
    weights, biases and norms) that sum to `total`."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.rand(count, generator=gen, dtype=torch.float64) * 7.0)
    sizes = [max(1, int(w)) for w in (weights / weights.sum() * total).tolist()]
    sizes[-1] += total - sum(sizes)
    return sizes


def time_ms(acc: Any, fn: Any) -> float:
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    acc.synchronize()
    return float(start.elapsed_time(end))


def main() -> int:
    args = parse_args()
    from deepspeed_ext.accelerator.cuda import CUDAAccelerator

    acc = CUDAAccelerator()
    if not acc.is_available():
        print("needs a CUDA GPU; skipped")
        return 0
    from deepspeed_ext.ops.adam import FusedAdam

    sizes = tensor_sizes(args.params, args.tensors)
    params = [torch.zeros(n, device="cuda").uniform_(-1, 1).requires_grad_() for n in sizes]
    for p in params:  # shared by both optimizers: step time does not depend on the values
        p.grad = torch.empty_like(p).normal_(std=1e-2)
    hp: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opts = {
        "deepspeed_ext FusedAdam": FusedAdam(params, adam_w_mode=True, **hp),
        "torch AdamW(fused=True)": torch.optim.AdamW(params, fused=True, **hp),
    }
    for opt in opts.values():  # builds our op on first use, allocates states
        for _ in range(args.warmup):
            opt.step()
    acc.synchronize()

    names = list(opts)
    raw: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else reversed(names):
            raw[name].append(time_ms(acc, opts[name].step))
    copy = copy_bandwidth(int(args.copy_gib * 2**30), max(args.reps, 5), device="cuda", warmup=3)
    copy_gbps = copy.gbps

    medians = {n: statistics.median(t) for n, t in raw.items()}
    gbps = {n: BYTES_PER_PARAM * args.params / (ms * 1e-3) / 1e9 for n, ms in medians.items()}
    base = medians["torch AdamW(fused=True)"]
    ratios = {n: ms / base for n, ms in medians.items()}  # time relative to torch; < 1 is faster
    gpu = torch.cuda.get_device_name()  # the model name; the accelerator API has none

    print(f"{args.params:,} fp32 params in {args.tensors} tensors on {gpu}, median of {args.reps}")
    print(f"device copy bandwidth: {copy_gbps:,.0f} GB/s (read + write)")
    print(f"{'optimizer':<26}{'median ms':>11}{'GB/s':>9}{'of copy bw':>12}{'time vs torch':>15}")
    for n in names:
        frac = gbps[n] / copy_gbps
        print(f"{n:<26}{medians[n]:>11.3f}{gbps[n]:>9.0f}{frac:>12.1%}{ratios[n]:>15.3f}")

    result = {
        "benchmark": "fused_adam",
        "workload": {
            "params": args.params,
            "tensors": args.tensors,
            "dtype": "float32",
            "bytes_per_param": BYTES_PER_PARAM,
            "reps": args.reps,
            "warmup": args.warmup,
            "smoke": args.smoke,
            "hyperparameters": {**hp, "betas": list(hp["betas"])},
        },
        "machine": machine_info("cuda"),
        "raw_ms": raw,
        "median_ms": medians,
        "effective_gbps": gbps,
        "copy": {"gib": args.copy_gib, **copy.as_dict()},
        "fraction_of_copy_bandwidth": {n: gbps[n] / copy_gbps for n in names},
        "time_ratio_vs_torch_fused": ratios,
    }
    print(f"wrote {write_result('fused_adam', result, args.smoke, path=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

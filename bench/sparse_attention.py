"""Benchmark: block-sparse attention (SparseSelfAttention on the C++ kernels) against torch's
scaled_dot_product_attention given the same layout as a dense boolean mask, and against dense
masked attention in plain torch ops; forward + backward, on the CPU.

Workload: batch 1, 4 heads, head_dim 64, fp32, blocks of 64, a bidirectional sliding-window
layout (LocalSlidingWindowSparsityConfig) whose width sets the sparsity. Each case runs each
implementation in its own process (fresh peak memory); time is the median of the rounds, memory
the peak resident set above the process's size before the first call. Every process runs under
an address-space limit (--mem-limit-gb, default 12 of this machine's 24 GiB): a case that needs
more fails with an out-of-memory error, reported as such. Goal (the issue): >= 4x
SDPA's speed at 90% sparsity and 4k tokens; time and memory that follow the non-zero blocks, so
16k tokens fit where dense does not.

    python bench/sparse_attention.py           # -> bench/results/sparse_attention.json
    python bench/sparse_attention.py --smoke   # one small case
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import busy_warning, machine_info, median, print_table, write_result

ROOT = Path(__file__).resolve().parent.parent
HEADS, DIM, BLOCK = 4, 64, 64
# (sequence length, window in blocks): the sparsity is 1 - (about) window / blocks
CASES = [(1024, 9), (1024, 3), (4096, 33), (4096, 7), (4096, 1), (16384, 25), (16384, 5)]
IMPLS = ["sparse", "sdpa", "dense"]


def run_case(impl: str, seq: int, window: int, rounds: int, limit_gb: float) -> dict[str, Any]:
    """In this process: `rounds` forward + backward passes of one implementation."""
    limit = int(limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from deepspeed_ext.ops.sparse_attention import (
        LocalSlidingWindowSparsityConfig,
        SparseSelfAttention,
    )

    torch.manual_seed(0)
    config = LocalSlidingWindowSparsityConfig(
        HEADS, BLOCK, num_sliding_window_blocks=window, attention="bidirectional"
    )
    att = SparseSelfAttention(config, max_seq_length=seq)
    layout = att.get_layout(seq)
    density = float(layout.float().mean())
    q, k, v = (torch.randn(1, HEADS, seq, DIM, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, HEADS, seq, DIM)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if impl == "sparse":

        def step() -> None:
            att(q, k, v).backward(grad)
    else:
        mask = layout.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2).bool()[None]

        def step() -> None:
            if impl == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                s = (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
                out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
            out.backward(grad)

    times = []
    for _ in range(rounds + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"median_s": median(times[1:]), "peak_mb": (peak - base) / 1024, "density": density}


def spawn(
    impl: str, seq: int, window: int, rounds: int, timeout: float, limit_gb: float
) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--case", impl, str(seq), str(window), str(rounds)]
    cmd.append(str(limit_gb))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    except subprocess.CalledProcessError as e:
        return {"error": (e.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--mem-limit-gb", type=float, default=12.0)
    ap.add_argument("--case", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        impl, seq, window, rounds, limit = args.case
        print(json.dumps(run_case(impl, int(seq), int(window), int(rounds), float(limit))))
        return 0
    cases = [(256, 1)] if args.smoke else CASES
    rounds = 1 if args.smoke else args.rounds
    results, rows = [], []
    for seq, window in cases:
        res = {
            impl: spawn(impl, seq, window, rounds, args.timeout, args.mem_limit_gb)
            for impl in IMPLS
        }
        ours = res["sparse"]
        entry = {"seq": seq, "window_blocks": window, "results": res}
        if ours and "median_s" in ours:
            entry["sparsity"] = 1 - ours["density"]
            for peer in ("sdpa", "dense"):
                r = res[peer]
                if r and "median_s" in r:
                    entry[f"speedup_vs_{peer}"] = r["median_s"] / ours["median_s"]
                    entry[f"memory_ratio_vs_{peer}"] = r["peak_mb"] / max(ours["peak_mb"], 1e-3)

        def cell(r: dict[str, Any] | None) -> str:
            if not r or "median_s" not in r:
                err = (r or {}).get("error", "failed")
                return "out of memory" if "allocate memory" in err else err[:40]
            return f"{r['median_s'] * 1e3:.0f} ms / {r['peak_mb']:.0f} MB"

        rows.append(
            [
                f"{seq} x {window} blocks",
                f"{entry.get('sparsity', float('nan')):.1%}",
                cell(ours),
                cell(res["sdpa"]),
                cell(res["dense"]),
                f"{entry.get('speedup_vs_sdpa', float('nan')):.2f}x",
            ]
        )
        results.append(entry)
        print(rows[-1], flush=True)
    print(
        f"SparseSelfAttention vs SDPA (dense bool mask) vs dense masked math: batch 1, "
        f"{HEADS} heads, head_dim {DIM}, block {BLOCK}, fp32, fwd+bwd median of {rounds}"
    )
    print_table(["seq x window", "sparsity", "sparse", "sdpa", "dense", "sparse vs sdpa"], rows)
    warn = busy_warning()
    if warn:
        print(warn)
    payload = {
        "benchmark": "sparse_attention",
        "workload": {
            "batch": 1,
            "heads": HEADS,
            "head_dim": DIM,
            "block": BLOCK,
            "dtype": "float32",
            "rounds": rounds,
            "smoke": args.smoke,
        },
        "machine": machine_info("cpu"),
        "cases": results,
        "memory_limit_gb": args.mem_limit_gb,
        "goal": ">= 4x SDPA at 90% sparsity, 4k tokens; 16k tokens fit where dense does not",
    }
    print(f"wrote {write_result('sparse_attention', payload, args.smoke)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

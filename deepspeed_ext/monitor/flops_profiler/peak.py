"""The peak the achieved FLOP/s are a fraction of, and where that peak comes from.

On a GPU whose dense tensor-core peak is published (H100, H200, A100) that figure; anywhere
else (the CPU, other devices) a GEMM peak measured here once per process, so the fraction
says how far the model is from what this machine's BLAS reaches, not from a paper number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# dense (non-sparse) peaks in FLOP/s of the vendors' data sheets, SXM parts
_PUBLISHED = {
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
}


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # printed beside the fraction, e.g. "measured fp32 GEMM peak (cpu)"


_measured: dict[tuple[str, torch.dtype], Peak] = {}


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    if device.type == "cuda":
        from deepspeed_ext.accelerator import get_accelerator

        name = get_accelerator().product_name(device.index or 0)
        for part, table in _PUBLISHED.items():
            if part in name and dtype in table:
                return Peak(table[dtype], f"published dense {_dtype(dtype)} peak of the {part}")
    return measured_peak(device, dtype)


def measured_peak(device: torch.device, dtype: torch.dtype, n: int = 1024) -> Peak:
    key = (str(device), dtype)
    if key not in _measured:
        from deepspeed_ext.accelerator import get_accelerator

        sync = get_accelerator().synchronize
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)  # warm-up: thread pools, BLAS plans
        sync()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
        _measured[key] = Peak(
            2 * n**3 / best, f"measured {_dtype(dtype)} GEMM peak ({device.type})"
        )
    return _measured[key]


def _dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )

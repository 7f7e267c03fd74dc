"""A rank that measures its own training peak (freed memory returned to the system, so the
resident set follows live tensors) and the whole-job estimate for the same run."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from torch import nn

WIDTH, DEPTH, BATCH = 1024, 24, 64  # 25.2M params: model states dominate, as in big jobs


def _kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(zero: dict[str, Any]) -> dict[str, int]:
    import torch._dynamo  # noqa: F401 - the optimizer imports it; its pages are not training's

    from deepspeed_ext.comm import init_distributed
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.memory_estimate import activation_bytes, estimate_job_memory

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD pinned: freed tensors are unmapped
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    init_distributed(verbose=False)
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    base = _kb("VmRSS")
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    act = activation_bytes(model, x)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    estimate = estimate_job_memory(model, cfg, torch.distributed.get_world_size(), act)
    engine, *_ = initialize(model=model, config=cfg)
    for step in range(4):
        if step == 1:  # steady: after the first step made the optimizer state
            Path("/proc/self/clear_refs").write_text("5")
        engine.backward(engine(x).square().mean())
        engine.step()
    return {
        "peak": _kb("VmHWM") - base,
        "estimate": estimate.total,
        "states": estimate.model_states,
    }

"""[Note: communication dtype]
`communication_data_type` reduces gradients in another dtype than they accumulate in: fp16
or bf16 halves the bytes each collective moves, fp32 keeps 16-bit accumulations exact in the
sum. The bucket is cast into a transient copy, the collective runs on the copy, and wait()
casts the result back into the accumulation buffer (stage 3's buckets are built in the
communication dtype to begin with, so they need no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CastBack:
    """A collective on `send` (a cast of `dst`, or of the buffer `dst` is a chunk of); wait()
    waits for it, then copies `result` (the part of `send` that holds dst's answer) into dst."""

    def __init__(self, work: Any, dst: torch.Tensor, result: torch.Tensor) -> None:
        self.work, self.dst, self.result = work, dst, result

    @property
    def segments(self) -> list[Any]:  # a hierarchical sum's steps ([Note: hierarchical all-reduce])
        return list(getattr(self.work, "segments", []))

    def wait(self) -> None:
        self.work.wait()
        self.dst.copy_(self.result)


def in_dtype(
    buf: torch.Tensor,
    dtype: torch.dtype | None,
    launch: Callable[[torch.Tensor], Any],
    answer: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Any:
    """launch(buf) when `dtype` is None or buf's own; else launch on a cast copy, and on
    wait() copy back the part of it that holds this rank's answer (`answer` of a buffer:
    all of it for an all-reduce, this rank's chunk for a reduce-scatter)."""
    if dtype is None or dtype == buf.dtype:
        return launch(buf)
    send = buf.to(dtype)
    return CastBack(launch(send), answer(buf), answer(send))

"""Sign compression for 1-bit communication ([Note: sign packing] in csrc/packbits).

`sign_compress(x, error)` packs the signs of x + error, 8 per byte, with one scale
(the root mean square of x + error, so that scale * sign keeps the tensor's L2 norm), and
leaves in `error` what the compression lost. `sign_decompress` is its inverse up to that
loss: +scale or -scale per element. CPU tensors run the SIMD op, CUDA tensors the CUDA op.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.op_builder import OpBuilder
from deepspeed_ext.op_builder.packbits import PackBitsBuilder

_ops: dict[str, Any] = {}


def _builder(device: torch.device) -> OpBuilder:
    if device.type == "cuda":
        from deepspeed_ext.op_builder.packbits_cuda import PackBitsCudaBuilder

        return PackBitsCudaBuilder()
    if device.type != "cpu":
        raise ValueError(f"sign compression runs on cpu or cuda tensors, not {device.type}")
    return PackBitsBuilder()


def op(device: torch.device) -> Any:
    key = device.type
    if key not in _ops:
        _ops[key] = _builder(device).load()
    return _ops[key]


def packed_numel(n: int) -> int:
    return (n + 7) // 8


def sign_compress(
    x: torch.Tensor, error: torch.Tensor | None = None, bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits, scale) of y = x + error (flattened); error := y - scale * sign(y)."""
    x = x.reshape(-1)
    ops = op(x.device)
    n = x.numel()
    scale = (ops.sum_squares(x, error) / max(n, 1)).sqrt().to(torch.float32).reshape(1)
    if bits is None:
        bits = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    ops.pack(x, error, scale, bits)
    return bits, scale


def sign_decompress(
    bits: torch.Tensor,
    scale: torch.Tensor,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """+scale / -scale per packed sign, into (or, with accumulate, added to) float32 `out`."""
    if out is None:
        if accumulate:
            raise ValueError("sign_decompress(accumulate=True) needs the `out` to add to")
        out = torch.empty(numel, dtype=torch.float32, device=bits.device)
    op(bits.device).unpack(bits, scale.reshape(1).to(torch.float32), out, accumulate)
    return out


__all__ = ["op", "packed_numel", "sign_compress", "sign_decompress"]

"""Chunk codecs for comm's compressed mean ([Note: compressed all-reduce]): what one chunk of
values becomes on the wire, and what it decodes to. Each keeps error feedback exact: the
error buffer ends as y minus what the payload decodes to.

[Note: gradient codecs]
- signs (1 bit a value): a scale (the chunk's root mean square, so the L2 norm survives) and
  the signs packed 8 per byte by the packbits op. 1/32 of fp32.
- 2bit: the sign and one of two magnitude levels a value: |y| at or above the chunk's mean
  |y| decodes to the mean |y| of those values, below it to the mean of the rest (the two
  scales travel with the chunk). Two bit planes packed by the packbits op. 1/16 of fp32,
  and a smaller error than signs alone.
- topk: the k = ceil(ratio c) values of largest |y| as (index, value) pairs, indices sorted
  and sent as int32 gaps (small numbers, which the Huffman row coder shrinks), values fp32;
  the rest stays in the error buffer until it grows large enough to be sent. 8 k bytes.
Payloads are multiples of 4 bytes so the scales and pairs are aligned float32/int32 views.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deepspeed_ext.ops.packbits import op as packbits_op
from deepspeed_ext.ops.packbits import packed_numel, sign_compress, sign_decompress


def _aligned(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


class SignCodec:
    """1 bit a value: signs and one scale a chunk."""

    name = "1bit"

    def wire_bytes(self, c: int) -> int:
        return 4 + _aligned(packed_numel(c))

    def encode(self, x: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        nb = packed_numel(x.numel())
        _, scale = sign_compress(x, error, bits=out[4 : 4 + nb])
        out[:4].view(torch.float32).copy_(scale)

    def decode(
        self, payload: torch.Tensor, c: int, out: torch.Tensor, weight: float, accumulate: bool
    ) -> None:
        scale = payload[:4].view(torch.float32) * weight
        sign_decompress(payload[4 : 4 + packed_numel(c)], scale, c, out, accumulate)


class TwoBitCodec:
    """2 bits a value: a sign and a low/high magnitude level, two scales a chunk. CPU
    tensors run the packbits op's two-bit kernels ([Note: two-bit packing]); others (and
    the tests' reference) the same math in torch ops."""

    name = "2bit"

    def wire_bytes(self, c: int) -> int:
        return 8 + 2 * _aligned(packed_numel(c))

    def encode(self, x: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        n, pn = x.numel(), packed_numel(x.numel())
        nb = _aligned(pn)
        signs, levels = out[8 : 8 + pn], out[8 + nb : 8 + nb + pn]
        if x.device.type != "cpu":
            return self.encode_torch(x, error, out)
        ops = packbits_op(x.device)
        x = x.reshape(-1)
        total, _ = ops.abs_sum_above(x, error, -1.0)
        cut = total / max(n, 1)
        high_sum, high_n = ops.abs_sum_above(x, error, cut)
        low = (total - high_sum) / max(n - high_n, 1)
        high = high_sum / max(high_n, 1)
        ops.pack2(x, error, cut, low, high, signs, levels)
        out[:8].view(torch.float32).copy_(torch.tensor([low, high], dtype=torch.float32))

    def decode(
        self, payload: torch.Tensor, c: int, out: torch.Tensor, weight: float, accumulate: bool
    ) -> None:
        if payload.device.type != "cpu":
            return self.decode_torch(payload, c, out, weight, accumulate)
        nb, pn = _aligned(packed_numel(c)), packed_numel(c)
        low, high = (payload[:8].view(torch.float32) * weight).tolist()
        signs, levels = payload[8 : 8 + pn], payload[8 + nb : 8 + nb + pn]
        packbits_op(payload.device).unpack2(signs, levels, low, high, out, accumulate)

    def encode_torch(self, x: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        y = x.reshape(-1).float() + error
        mag = y.abs()
        cut = mag.mean()
        high = mag >= cut
        n_high = high.sum()
        levels = torch.stack(
            [
                torch.where(high, 0, mag).sum() / (y.numel() - n_high).clamp(min=1),
                torch.where(high, mag, 0).sum() / n_high.clamp(min=1),
            ]
        )
        error.copy_(y - torch.where(high, levels[1], levels[0]) * torch.where(y >= 0, 1.0, -1.0))
        one = _one(y.device)
        nb = _aligned(packed_numel(y.numel()))
        ops = packbits_op(y.device)
        ops.pack(y, None, one, out[8 : 8 + packed_numel(y.numel())])
        ops.pack(mag - cut, None, one, out[8 + nb : 8 + nb + packed_numel(y.numel())])
        out[:8].view(torch.float32).copy_(levels)

    def decode_torch(
        self, payload: torch.Tensor, c: int, out: torch.Tensor, weight: float, accumulate: bool
    ) -> None:
        nb, pn = _aligned(packed_numel(c)), packed_numel(c)
        low, high = (payload[:8].view(torch.float32) * weight).unbind()
        one = _one(out.device)
        sign = sign_decompress(payload[8 : 8 + pn], one, c)  # +-1
        level = sign_decompress(payload[8 + nb : 8 + nb + pn], one, c)  # +-1: high or low
        value = sign * (low + (level + 1) * 0.5 * (high - low))
        if accumulate:
            out.add_(value)
        else:
            out.copy_(value)


class TopKCodec:
    """The largest |values| as sorted (index, value) pairs."""

    name = "topk"

    def __init__(self, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"topk_ratio={ratio}: expected a fraction in (0, 1]")
        self.ratio = ratio

    def k(self, c: int) -> int:
        return min(c, max(1, math.ceil(self.ratio * c)))

    def wire_bytes(self, c: int) -> int:
        return 8 * self.k(c)

    def encode(self, x: torch.Tensor, error: torch.Tensor, out: torch.Tensor) -> None:
        y = x.reshape(-1).float() + error
        k = self.k(y.numel())
        index = _largest(y.abs(), k)
        values = y[index]
        error.copy_(y)
        error[index] = 0
        gaps = torch.diff(index, prepend=index.new_zeros(1))
        out[: 4 * k].view(torch.int32).copy_(gaps)
        out[4 * k : 8 * k].view(torch.float32).copy_(values)

    def decode(
        self, payload: torch.Tensor, c: int, out: torch.Tensor, weight: float, accumulate: bool
    ) -> None:
        k = self.k(c)
        index = payload[: 4 * k].view(torch.int32).cumsum(0)
        values = payload[4 * k : 8 * k].view(torch.float32)
        if not accumulate:
            out.zero_()
        out.index_add_(0, index, values, alpha=weight)


def _largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest values, ascending. Exact: a threshold from a sample keeps
    a few more than k candidates (every one of the k largest among them whenever at least k
    pass it), and the exact top-k runs on those only; when too few pass, on everything."""
    n = mag.numel()
    if k * 8 < n and n > _SAMPLE:
        gen = torch.Generator(device=mag.device).manual_seed(n)  # the same bits every call
        sample = mag[torch.randint(0, n, (_SAMPLE,), device=mag.device, generator=gen)]
        # aim for 1.5 k candidates (a few extra against the sample's noise)
        keep = max(1, int(_SAMPLE * (1 - 1.5 * k / n)))
        candidates = (mag >= sample.kthvalue(keep).values).nonzero().view(-1)
        if candidates.numel() >= k:
            best = mag[candidates].topk(k, sorted=False).indices
            return candidates[best].sort().values
    return mag.topk(k, sorted=False).indices.sort().values


_SAMPLE = 16384

_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A scale of 1 for bit planes that carry no scale of their own."""
    if device not in _ONES:
        _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _ONES[device]


def codec_for(algorithm: str, topk_ratio: float = 0.01) -> Any:
    if algorithm == "1bit":
        return SignCodec()
    if algorithm == "2bit":
        return TwoBitCodec()
    if algorithm == "topk":
        return TopKCodec(topk_ratio)
    raise ValueError(f"gradient_compression.algorithm={algorithm!r}: expected 1bit, 2bit or topk")

"""The transformer layer's kernels behind one interface ([Note: transformer kernels] in
csrc/transformer): the C++ op on CPU tensors, the CUDA op on CUDA tensors, the same math in
torch ops elsewhere (and on CUDA when its op cannot be built: said once). All draw dropout
masks from [Note: replayed dropout], so a layer's masks depend on (seed, offset) only, never
on the device."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from deepspeed_ext.op_builder.errors import OpBuildError
from deepspeed_ext.op_builder.transformer import TransformerBuilder
from deepspeed_ext.op_builder.transformer_cuda import TransformerCudaBuilder

from ..masked_softmax import softmax_or_zeros

_op: Any = None
_cuda_op: Any = None  # False once the CUDA op failed to build


def op() -> Any:
    global _op
    if _op is None:
        _op = TransformerBuilder().load()
    return _op


# -- [Note: replayed dropout] in torch ops -------------------------------------------------------
# uint64 arithmetic on int64 tensors: multiplication and xor wrap the same bits; right shifts
# are arithmetic, so each one masks off the sign-extended bits.

_M64 = [0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB]


def _s64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = z + _s64(_M64[0])
    z = (z ^ _shr(z, 30)) * _s64(_M64[1])
    z = (z ^ _shr(z, 27)) * _s64(_M64[2])
    return z ^ _shr(z, 31)


def drop_threshold(p: float) -> int:
    if p <= 0:
        return 0
    if p >= 1:
        return 1 << 16
    return int(p * 65536.0 + 0.5)


def dropout_keep_mask(
    numel: int, p: float, seed: int, offset: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The keep mask (bool, [numel]) of the dropout call (seed, offset): element i's 16 bits
    are bits 16 * (j % 4) of splitmix64's draw for group j // 4, j = offset + i."""
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    key = int(_mix64(torch.tensor([seed], dtype=torch.int64))[0]) % (1 << 64)
    group = (index >> 2) * _s64(_M64[0]) + _s64(key)
    # a shift by <= 48 keeps 16 true bits above any sign extension; the mask drops the rest
    bits = (_mix64(group) >> ((index & 3) * 16)) & 0xFFFF
    return bits >= drop_threshold(p)


def dropout_scale(p: float) -> float:
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


# -- the kernels ---------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _OpKernels:
    """A compiled op ([Note: transformer kernels]): `_lib()` gives its torch.ops namespace."""

    @staticmethod
    def _lib() -> Any:
        raise NotImplementedError

    @classmethod
    def layer_norm_fwd(cls, x, gamma, beta, eps):
        return cls._lib().layer_norm_fwd(x.contiguous(), gamma.contiguous(), beta.contiguous(), eps)

    @classmethod
    def layer_norm_bwd(cls, dy, src, src_is_output, gamma, beta, mean, rstd):
        return cls._lib().layer_norm_bwd(
            dy.contiguous(), src, src_is_output, gamma.contiguous(), beta.contiguous(), mean, rstd
        )

    @classmethod
    def bias_gelu_fwd(cls, x, bias):
        return cls._lib().bias_gelu_fwd(x.contiguous(), bias.contiguous())

    @classmethod
    def bias_gelu_bwd(cls, dy, x, bias):
        return cls._lib().bias_gelu_bwd(dy.contiguous(), x.contiguous(), bias.contiguous())

    @classmethod
    def bias_dropout_residual(cls, x, bias, residual, p, seed, offset):
        return cls._lib().bias_dropout_residual(
            x.contiguous(), bias.contiguous(), residual.contiguous(), p, seed, offset
        )

    @classmethod
    def dropout(cls, x, p, seed, offset):
        return cls._lib().dropout(x.contiguous(), p, seed, offset)

    @classmethod
    def softmax_fwd(cls, scores, mask, scale):
        return cls._lib().softmax_fwd(scores.contiguous(), mask, scale)

    @classmethod
    def softmax_bwd(cls, dprobs, probs, scale):
        return cls._lib().softmax_bwd(dprobs.contiguous(), probs, scale)


class CPUKernels(_OpKernels):
    @staticmethod
    def _lib() -> Any:
        return op()


class CUDAKernels(_OpKernels):
    @staticmethod
    def _lib() -> Any:
        if not _cuda_available():
            raise RuntimeError("the transformer CUDA op could not be built (warned above)")
        return _cuda_op


class TorchKernels:
    """The same math in torch ops (fp32 inside, stored in the input's dtype)."""

    @staticmethod
    def layer_norm_fwd(x, gamma, beta, eps):
        xf = x.float()
        mean = xf.mean(-1)
        rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
        y = (xf - mean[..., None]) * rstd[..., None] * gamma.float() + beta.float()
        return y.to(x.dtype), mean.reshape(-1), rstd.reshape(-1)

    @staticmethod
    def layer_norm_bwd(dy, src, src_is_output, gamma, beta, mean, rstd):
        g, b = gamma.float(), beta.float()
        s, d = _rows(src).float(), _rows(dy).float()
        mean, rstd = mean[:, None], rstd[:, None]
        xhat = (s - b) / g if src_is_output else (s - mean) * rstd
        dxhat = d * g
        dx = rstd * (
            dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
        )
        return dx.reshape(src.shape).to(src.dtype), (d * xhat).sum(0), d.sum(0)

    @staticmethod
    def _gelu_parts(u):
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (u + 0.044715 * u**3))
        return t, k

    @staticmethod
    def bias_gelu_fwd(x, bias):
        u = x.float() + bias.float()
        t, _ = TorchKernels._gelu_parts(u)
        return (0.5 * u * (1 + t)).to(x.dtype)

    @staticmethod
    def bias_gelu_bwd(dy, x, bias):
        u = x.float() + bias.float()
        t, k = TorchKernels._gelu_parts(u)
        grad = 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * k * (1 + 3 * 0.044715 * u * u)
        return (dy.float() * grad).to(x.dtype)

    @staticmethod
    def bias_dropout_residual(x, bias, residual, p, seed, offset):
        keep = dropout_keep_mask(x.numel(), p, seed, offset, x.device).view(x.shape)
        v = (x.float() + bias.float()) * keep * dropout_scale(p)
        return (residual.float() + v).to(x.dtype)

    @staticmethod
    def dropout(x, p, seed, offset):
        keep = dropout_keep_mask(x.numel(), p, seed, offset, x.device).view(x.shape)
        return (x.float() * keep * dropout_scale(p)).to(x.dtype)

    @staticmethod
    def softmax_fwd(scores, mask, scale):
        s = scores.float() * scale
        if mask is not None:
            s = s + mask[:, None]  # [b, 1|sq, sk] -> over heads
        probs = softmax_or_zeros(s)
        return probs.to(scores.dtype)

    @staticmethod
    def softmax_bwd(dprobs, probs, scale):
        d, pr = dprobs.float(), probs.float()
        return (scale * pr * (d - (d * pr).sum(-1, keepdim=True))).to(probs.dtype)


def _cuda_available() -> bool:
    global _cuda_op
    if _cuda_op is None:
        try:
            _cuda_op = TransformerCudaBuilder().load()
        except OpBuildError as e:
            warnings.warn(
                f"transformer CUDA kernels unavailable, using torch ops: {e}", stacklevel=2
            )
            _cuda_op = False
    return _cuda_op is not False


def kernels_for(t: torch.Tensor) -> Any:
    if t.device.type == "cpu":
        return CPUKernels
    if t.device.type == "cuda" and _cuda_available():
        return CUDAKernels
    return TorchKernels

"""Autograd functions over the transformer kernels. Each saves only what its backward needs;
the memory options of DeepSpeedTransformerConfig choose between variants that save less and
recompute ([Note: transformer memory options])."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from .kernels import kernels_for


def _rows_sum(x: torch.Tensor) -> torch.Tensor:
    # accumulates in fp32 without an fp32 copy of x (as large as the activation)
    return x.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32)


class LayerNormFn(Function):
    """LayerNorm; `invertible` saves the output instead of the input (normalize_invertible):
    backward recomputes x-hat from y, so the input can be freed after the forward."""

    @staticmethod
    def forward(ctx: Any, x, gamma, beta, eps: float, invertible: bool):
        y, mean, rstd = kernels_for(x).layer_norm_fwd(x, gamma, beta, eps)
        ctx.invertible = invertible
        ctx.save_for_backward(y if invertible else x, gamma, beta, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy):
        src, gamma, beta, mean, rstd = ctx.saved_tensors
        dx, dg, db = kernels_for(src).layer_norm_bwd(
            dy, src, ctx.invertible, gamma, beta, mean, rstd
        )
        return dx, dg.to(gamma.dtype), db.to(beta.dtype), None, None


class BiasGeluFn(Function):
    """gelu(x + bias), tanh approximation."""

    @staticmethod
    def forward(ctx: Any, x, bias):
        ctx.save_for_backward(x, bias)
        return kernels_for(x).bias_gelu_fwd(x, bias)

    @staticmethod
    def backward(ctx: Any, dy):
        x, bias = ctx.saved_tensors
        dx = kernels_for(x).bias_gelu_bwd(dy, x, bias)
        return dx, _rows_sum(dx).to(bias.dtype)


class BiasGeluLinearFn(Function):
    """linear(gelu(x + bias), w) keeping only x (gelu_checkpoint): the GeLU output, as large
    as x, is recomputed in backward instead of saved for the GEMM."""

    @staticmethod
    def forward(ctx: Any, x, bias, w):
        ctx.save_for_backward(x, bias, w)
        return F.linear(kernels_for(x).bias_gelu_fwd(x, bias), w)

    @staticmethod
    def backward(ctx: Any, dout):
        x, bias, w = ctx.saved_tensors
        k = kernels_for(x)
        g = k.bias_gelu_fwd(x, bias)
        dw = dout.reshape(-1, dout.shape[-1]).t() @ g.reshape(-1, g.shape[-1])
        dx = k.bias_gelu_bwd(dout @ w, x, bias)
        return dx, _rows_sum(dx).to(bias.dtype), dw


class BiasDropoutResidualFn(Function):
    """residual + dropout(x + bias); the mask is replayed from (seed, offset)."""

    @staticmethod
    def forward(ctx: Any, x, bias, residual, p: float, seed: int, offset: int):
        ctx.p, ctx.seed, ctx.offset, ctx.bias_dtype = p, seed, offset, bias.dtype
        return kernels_for(x).bias_dropout_residual(x, bias, residual, p, seed, offset)

    @staticmethod
    def backward(ctx: Any, dout):
        dx = kernels_for(dout).dropout(dout, ctx.p, ctx.seed, ctx.offset)
        return dx, _rows_sum(dx).to(ctx.bias_dtype), dout, None, None, None


class DropoutFn(Function):
    @staticmethod
    def forward(ctx: Any, x, p: float, seed: int, offset: int):
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        return kernels_for(x).dropout(x, p, seed, offset)

    @staticmethod
    def backward(ctx: Any, dy):
        return kernels_for(dy).dropout(dy, ctx.p, ctx.seed, ctx.offset), None, None, None


class DropoutMatmulFn(Function):
    """dropout(probs) @ v keeping only probs and v (attn_dropout_checkpoint): the dropped
    probabilities are recomputed from the replayed mask instead of saved."""

    @staticmethod
    def forward(ctx: Any, probs, v, p: float, seed: int, offset: int):
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        v = v.contiguous()  # a view of the fused qkv would keep q and k alive too
        ctx.save_for_backward(probs, v)
        return kernels_for(probs).dropout(probs, p, seed, offset) @ v

    @staticmethod
    def backward(ctx: Any, dctx):
        probs, v = ctx.saved_tensors
        k = kernels_for(probs)
        dropped = k.dropout(probs, ctx.p, ctx.seed, ctx.offset)
        dprobs = k.dropout(dctx @ v.transpose(-1, -2), ctx.p, ctx.seed, ctx.offset)
        return dprobs, dropped.transpose(-1, -2) @ dctx, None, None, None


class SoftmaxFn(Function):
    """softmax(scores * scale + mask) over the last dimension; the mask takes no gradient."""

    @staticmethod
    def forward(ctx: Any, scores, mask, scale: float):
        probs = kernels_for(scores).softmax_fwd(scores, mask, scale)
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx: Any, dprobs):
        (probs,) = ctx.saved_tensors
        return kernels_for(probs).softmax_bwd(dprobs, probs, ctx.scale), None, None


class LayerFn(Function):
    """The whole layer in one compiled op each way ([Note: transformer layer op] in
    csrc/bindings/transformer_layer.h): `opts` are the op's scalars, heads .. attn_drop_ckpt;
    the op returns the tensors its backward needs, which depend on the memory options."""

    @staticmethod
    def forward(ctx: Any, x, mask, opts: tuple, *params):
        lib = kernels_for(x)._lib()
        out, saved = lib.layer_fwd(x, mask, list(params), *opts, True)
        ctx.opts, ctx.n_saved = opts, len(saved)
        ctx.save_for_backward(*saved, *params)
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        t = ctx.saved_tensors
        saved, params = t[: ctx.n_saved], t[ctx.n_saved :]
        lib = kernels_for(dout)._lib()
        dx, dparams = lib.layer_bwd(dout, list(saved), list(params), *ctx.opts)
        return (dx, None, None, *dparams)

"""Block-sparse matrix products (upstream's deepspeed.ops.sparse_attention.MatMul), with
their backward, over [Note: block-sparse kernels].

Modes name the operands: 'sdd' makes a sparse result of two dense operands (only the layout's
blocks are computed), 'dsd' multiplies a sparse left operand by a dense one, 'dds' a dense left
operand by a sparse one. Dense operands are [batch, heads, rows, cols]; trans_a / trans_b use
an operand transposed (no copy is made)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from .kernels import path_for
from .lut import Lut, lut_for

_MODES = ("sdd", "dsd", "dds")


def _t(x: torch.Tensor | None, trans: bool) -> torch.Tensor | None:
    return x.transpose(-1, -2) if x is not None and trans else x


def _forward(ctx: Any, mode: str, x, tx: bool, y, ty: bool, lut: Lut):
    """Every product's forward: keep the operands and flags for its backward, and compute."""
    ctx.save_for_backward(x, y)
    ctx.args = (tx, ty, lut)
    return getattr(path_for(x), mode)(x, tx, y, ty, lut)


class _SDD(Function):
    @staticmethod
    def forward(ctx: Any, a, b, trans_a: bool, trans_b: bool, lut: Lut):
        return _forward(ctx, "sdd", a, trans_a, b, trans_b, lut)

    @staticmethod
    def backward(ctx: Any, dc):
        a, b = ctx.saved_tensors
        ta, tb, lut = ctx.args
        p = path_for(dc)
        da = db = None
        if ctx.needs_input_grad[0]:  # dA = dC B^T
            da = _t(p.dsd(dc, False, b, not tb, lut), ta)
        if ctx.needs_input_grad[1]:  # dB = A^T dC
            db = _t(p.dds(a, not ta, dc, False, lut), tb)
        return da, db, None, None, None


class _DSD(Function):
    @staticmethod
    def forward(ctx: Any, s, b, trans_s: bool, trans_b: bool, lut: Lut):
        return _forward(ctx, "dsd", s, trans_s, b, trans_b, lut)

    @staticmethod
    def backward(ctx: Any, dc):
        s, b = ctx.saved_tensors
        ts, tb, lut = ctx.args
        p = path_for(dc)
        ds = db = None
        if ctx.needs_input_grad[0]:  # dS = dC B^T on S's blocks (stored orientation)
            ds = p.sdd(b, tb, dc, True, lut) if ts else p.sdd(dc, False, b, not tb, lut)
        if ctx.needs_input_grad[1]:  # dB = S^T dC
            db = _t(p.dsd(s, not ts, dc, False, lut), tb)
        return ds, db, None, None, None


class _DDS(Function):
    @staticmethod
    def forward(ctx: Any, a, s, trans_a: bool, trans_s: bool, lut: Lut):
        return _forward(ctx, "dds", a, trans_a, s, trans_s, lut)

    @staticmethod
    def backward(ctx: Any, dc):
        a, s = ctx.saved_tensors
        ta, ts, lut = ctx.args
        p = path_for(dc)
        da = ds = None
        if ctx.needs_input_grad[0]:  # dA = dC S^T
            da = _t(p.dds(dc, False, s, not ts, lut), ta)
        if ctx.needs_input_grad[1]:  # dS = A^T dC on S's blocks
            ds = p.sdd(dc, True, a, ta, lut) if ts else p.sdd(a, not ta, dc, False, lut)
        return da, ds, None, None, None


class MatMul:
    """c = op(a) @ op(b) on a block layout ([heads, blocks, blocks] of 0/1)."""

    def __init__(
        self,
        layout: torch.Tensor,
        block: int,
        mode: str,
        trans_a: bool = False,
        trans_b: bool = False,
        bench: bool = False,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: expected one of {_MODES}")
        self.lut = lut_for(layout, block)
        self.layout, self.block, self.mode = layout, block, mode
        self.trans_a, self.trans_b = trans_a, trans_b

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype != b.dtype:
            raise ValueError(f"MatMul: a is {a.dtype} but b is {b.dtype}; they must match")
        fn = {"sdd": _SDD, "dsd": _DSD, "dds": _DDS}[self.mode]
        return fn.apply(a, b, self.trans_a, self.trans_b, self.lut)

"""Block-sparse softmax (upstream's deepspeed.ops.sparse_attention.Softmax), with its
backward: softmax(x * scale + rpe + key padding mask + attention mask) over each row's
non-zero blocks ([Note: block-sparse kernels])."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from .kernels import path_for, to_dense
from .lut import Lut, lut_for

_MODES = ("add", "mul")
MASK_FLOOR = -1e4


def additive(mask: torch.Tensor | None, mode: str, name: str) -> torch.Tensor | None:
    """A mask as fp32 to add: 'add' masks as given, 'mul' masks as 0 -> -inf, else 0.

    [Note: additive mask floor]
    Finite 'add' values below MASK_FLOOR (-1e4, BERT's own mask value) are raised to it;
    -inf stays -inf. A key under the floor gets weight exp(-1e4) = 0 in fp32 either way, so
    rows with any key left are unchanged. What changes is a row whose every key is masked by
    a huge finite value (-1e9, finfo.min as Hugging Face builds masks): in fp32 such scores
    lose their own digits, the unfused softmax returned a rounding-made average, and the
    fused kernels' log-sum-exp lost its log(sum) term (their backward then disagreed with
    their forward), or overflowed to -inf in log2 units. At the floor both paths keep the
    scores' digits and agree: the row attends as if the constant mask were not there (softmax
    is shift-invariant). A row masked by -inf ('mul', or -inf given) gives zeros."""
    if mask is None:
        return None
    if mode not in _MODES:
        raise ValueError(f"{name}_mode={mode!r}: expected 'add' or 'mul'")
    if mode == "mul" or mask.dtype == torch.bool:
        keep = mask if mask.dtype == torch.bool else mask != 0
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~keep, float("-inf"))
    m = mask.float()
    return torch.where((m < MASK_FLOOR) & (m != float("-inf")), MASK_FLOOR, m).contiguous()


class _Softmax(Function):
    @staticmethod
    def forward(ctx: Any, x, rpe, scale: float, kp, attn, lut: Lut):
        rpe32 = None if rpe is None else rpe.float()
        y = path_for(x).softmax_fwd(x, scale, rpe32, kp, attn, lut)
        ctx.save_for_backward(y)
        ctx.scale, ctx.lut, ctx.rpe_dtype = scale, lut, None if rpe is None else rpe.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy):
        (y,) = ctx.saved_tensors
        p = path_for(y)
        dx = drpe = None
        if ctx.needs_input_grad[0]:
            dx = p.softmax_bwd(y, dy, ctx.scale, ctx.lut)
        if ctx.needs_input_grad[1]:  # the bias enters unscaled: its gradient is dz
            dz = p.softmax_bwd(y, dy, 1.0, ctx.lut)
            drpe = to_dense(dz.float(), ctx.lut).to(ctx.rpe_dtype)
        return dx, drpe, None, None, None, None


class Softmax:
    """Softmax over a block-sparse tensor [batch, nnz, block, block] of `layout`."""

    def __init__(self, layout: torch.Tensor, block: int, bench: bool = False) -> None:
        self.lut = lut_for(layout, block)
        self.layout, self.block = layout, block
        self.num_blocks = self.lut.nnz
        self.spdims = tuple(layout.shape)

    def __call__(
        self,
        x: torch.Tensor,
        scale: float = 1.0,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "add",
    ) -> torch.Tensor:
        side = self.lut.nb * self.block
        if rpe is not None:
            if rpe.dim() == 3:
                rpe = rpe[None]
            if (
                rpe.dim() != 4
                or tuple(rpe.shape[1:]) != (self.lut.num_heads, side, side)
                or rpe.shape[0] not in (1, x.shape[0])
            ):
                raise ValueError(
                    f"rpe has shape {tuple(rpe.shape)}; expected [{x.shape[0]} (the batch) or 1, "
                    f"{self.lut.num_heads}, {side}, {side}]"
                )
            if rpe.stride(-1) != 1:  # the kernels read rows: a transposed view, a slice
                rpe = rpe.contiguous()
            if rpe.shape[0] == 1 and x.shape[0] > 1:
                rpe = rpe.expand(x.shape[0], -1, -1, -1)
        kp = additive(key_padding_mask, key_padding_mask_mode, "key_padding_mask")
        attn = additive(attn_mask, attn_mask_mode, "attn_mask")
        return _Softmax.apply(x, rpe, scale, kp, attn, self.lut)

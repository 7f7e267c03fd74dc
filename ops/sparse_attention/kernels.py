"""The block-sparse products and softmax behind one interface: the C++ op on CPU tensors, the
CUDA op on CUDA tensors, the same math in torch ops (block gathers and batched GEMMs)
elsewhere, and on CUDA when its op cannot be built (said once). Sparse tensors are
[batch, nnz, block, block], blocks in the layout's (head, row, column) order; dense operands
are [batch, heads, rows, cols], read transposed when asked."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from deepspeed_ext.op_builder.errors import OpBuildError
from deepspeed_ext.op_builder.sparse_attention import SparseAttnBuilder
from deepspeed_ext.op_builder.sparse_attention_cuda import SparseAttnCudaBuilder

from ..masked_softmax import softmax_or_zeros
from .lut import Lut

_op: Any = None
_cuda_op: Any = None  # False once the CUDA op failed to build


def op() -> Any:
    global _op
    if _op is None:
        _op = SparseAttnBuilder().load()
        _register_fakes("ds_sparse_attention")
    return _op


def cuda_op() -> Any:
    if not _cuda_available():
        raise RuntimeError("the sparse attention CUDA op could not be built (warned above)")
    return _cuda_op


def _cuda_available() -> bool:
    global _cuda_op
    if _cuda_op is None:
        try:
            _cuda_op = SparseAttnCudaBuilder().load()
            _register_fakes("ds_sparse_attention_cuda", softmax_heads=True)
            register_flash_autograd("ds_sparse_attention_cuda")
        except OpBuildError as e:
            warnings.warn(
                f"sparse attention CUDA kernels unavailable, using torch ops: {e}", stacklevel=2
            )
            _cuda_op = False
    return _cuda_op is not False


def _register_fakes(lib: str, softmax_heads: bool = False) -> None:
    """Shapes of each op's result from its inputs alone, so torch.compile can trace them. The
    CUDA op's softmax takes the head count as well, and it has the fused attention ops."""

    @torch.library.register_fake(f"{lib}::sdd")
    def _sdd(a, trans_a, b, trans_b, lut, nnz, block):
        return a.new_empty(a.shape[0], nnz, block, block)

    @torch.library.register_fake(f"{lib}::dsd")
    def _dsd(s, trans_s, b, trans_b, lut):
        bl = b.transpose(-1, -2) if trans_b else b
        return s.new_empty(s.shape[0], bl.shape[1], bl.shape[2], bl.shape[3])

    @torch.library.register_fake(f"{lib}::dds")
    def _dds(a, trans_a, s, trans_s, lut):
        al = a.transpose(-1, -2) if trans_a else a
        return s.new_empty(s.shape[0], al.shape[1], al.shape[2], al.shape[3])

    if softmax_heads:

        @torch.library.register_fake(f"{lib}::softmax_fwd")
        def _softmax_fwd_h(x, scale, rpe, kp, attn, lut, heads):
            return torch.empty_like(x)

        @torch.library.register_fake(f"{lib}::softmax_bwd")
        def _softmax_bwd_h(y, dy, scale, lut, heads):
            return torch.empty_like(y)

        @torch.library.register_fake(f"{lib}::flash_fwd")
        def _flash_fwd(q, k, v, lut, block, scale, tile_mask=None, key_bias=None):
            return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

        @torch.library.register_fake(f"{lib}::flash_bwd")
        def _flash_bwd(q, k, v, o, lse, dout, lut, block, scale, tile_mask=None, key_bias=None):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        return

    @torch.library.register_fake(f"{lib}::softmax_fwd")
    def _softmax_fwd(x, scale, rpe, kp, attn, lut):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{lib}::softmax_bwd")
    def _softmax_bwd(y, dy, scale, lut):
        return torch.empty_like(y)


def register_flash_autograd(lib: str) -> None:
    """flash_fwd's backward is flash_bwd, from the saved inputs, output and log-sum-exp (and
    the tile mask and key bias, which get no gradient, as the unfused softmax's masks). As a
    custom op's autograd (not an autograd.Function), so torch.compile traces it, also when one
    tensor is passed as q, k and v."""

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, lut, block, scale, tile_mask, key_bias = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, lut, tile_mask, key_bias)
        ctx.block, ctx.scale = block, scale

    def backward(ctx: Any, do: torch.Tensor, _dlse: Any) -> tuple:
        q, k, v, o, lse, lut, tile_mask, key_bias = ctx.saved_tensors
        flash_bwd = getattr(torch.ops, lib).flash_bwd
        dq, dk, dv = flash_bwd(
            q, k, v, o, lse, do.contiguous(), lut, ctx.block, ctx.scale, tile_mask, key_bias
        )
        return dq, dk, dv, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::flash_fwd", backward, setup_context=setup_context)


def _logical(x: torch.Tensor, trans: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if trans else x


def _col_blocks(x: torch.Tensor, lut: Lut) -> torch.Tensor:
    """[b, h, m, nb*block] -> [b, h, nb, m, block]: the column blocks of a dense operand."""
    b, h, m, _ = x.shape
    return x.reshape(b, h, m, lut.nb, lut.block).permute(0, 1, 3, 2, 4)


def _row_blocks(x: torch.Tensor, lut: Lut) -> torch.Tensor:
    b, h, _, n = x.shape
    return x.reshape(b, h, lut.nb, lut.block, n)


class TorchPath:
    @staticmethod
    def sdd(a, trans_a, b, trans_b, lut: Lut):
        a_rows = _row_blocks(_logical(a, trans_a), lut)[:, lut.heads, lut.rows]
        b_cols = _col_blocks(_logical(b, trans_b), lut)[:, lut.heads, lut.cols]
        return a_rows @ b_cols

    @staticmethod
    def dsd(s, trans_s, b, trans_b, lut: Lut):
        bl = _logical(b, trans_b)
        out_rows, k_rows = (lut.cols, lut.rows) if trans_s else (lut.rows, lut.cols)
        prod = _logical(s, trans_s) @ _row_blocks(bl, lut)[:, lut.heads, k_rows]
        out = torch.zeros(
            bl.shape[0],
            lut.num_heads * lut.nb,
            lut.block,
            bl.shape[-1],
            dtype=prod.dtype,
            device=prod.device,
        )
        out.index_add_(1, lut.heads.to(prod.device) * lut.nb + out_rows.to(prod.device), prod)
        return out.reshape(bl.shape[0], lut.num_heads, lut.nb * lut.block, bl.shape[-1])

    @staticmethod
    def dds(a, trans_a, s, trans_s, lut: Lut):
        al = _logical(a, trans_a)
        out_cols, k_cols = (lut.rows, lut.cols) if trans_s else (lut.cols, lut.rows)
        prod = _col_blocks(al, lut)[:, lut.heads, k_cols] @ _logical(s, trans_s)
        b, _, m, _ = al.shape
        out = torch.zeros(
            b, lut.num_heads * lut.nb, m, lut.block, dtype=prod.dtype, device=prod.device
        )
        out.index_add_(1, lut.heads.to(prod.device) * lut.nb + out_cols.to(prod.device), prod)
        out = out.reshape(b, lut.num_heads, lut.nb, m, lut.block).permute(0, 1, 3, 2, 4)
        return out.reshape(b, lut.num_heads, m, lut.nb * lut.block)

    @staticmethod
    def softmax_fwd(x, scale, rpe, kp, attn, lut: Lut):
        b = x.shape[0]
        dense = to_dense(x.float() * scale, lut, fill=float("-inf"))
        if rpe is not None:
            dense = dense + rpe
        if kp is not None:
            dense = dense + kp[:, None, None, :]
        if attn is not None:
            dense = dense + attn
        probs = softmax_or_zeros(dense)
        return from_dense(probs, lut).to(x.dtype).reshape(b, lut.nnz, lut.block, lut.block)

    @staticmethod
    def softmax_bwd(y, dy, scale, lut: Lut):
        yf, df = y.float(), dy.float()
        dot = to_dense(yf * df, lut, fill=0.0).sum(-1, keepdim=True)
        dot_blocks = from_dense(dot.expand(-1, -1, -1, lut.nb * lut.block), lut)
        return (scale * yf * (df - dot_blocks)).to(y.dtype)


class CPUPath:
    @staticmethod
    def sdd(a, trans_a, b, trans_b, lut: Lut):
        return op().sdd(a, trans_a, b, trans_b, lut.packed, lut.nnz, lut.block)

    @staticmethod
    def dsd(s, trans_s, b, trans_b, lut: Lut):
        return op().dsd(s.contiguous(), trans_s, b, trans_b, lut.packed)

    @staticmethod
    def dds(a, trans_a, s, trans_s, lut: Lut):
        return op().dds(a, trans_a, s.contiguous(), trans_s, lut.packed)

    @staticmethod
    def softmax_fwd(x, scale, rpe, kp, attn, lut: Lut):
        return op().softmax_fwd(x.contiguous(), scale, rpe, kp, attn, lut.packed)

    @staticmethod
    def softmax_bwd(y, dy, scale, lut: Lut):
        return op().softmax_bwd(y, dy.contiguous(), scale, lut.packed)


class CUDAPath:
    """The CUDA op, with the table copied to the operands' device once per layout."""

    @staticmethod
    def sdd(a, trans_a, b, trans_b, lut: Lut):
        return cuda_op().sdd(a, trans_a, b, trans_b, lut.on(a.device), lut.nnz, lut.block)

    @staticmethod
    def dsd(s, trans_s, b, trans_b, lut: Lut):
        return cuda_op().dsd(s.contiguous(), trans_s, b, trans_b, lut.on(s.device))

    @staticmethod
    def dds(a, trans_a, s, trans_s, lut: Lut):
        return cuda_op().dds(a, trans_a, s.contiguous(), trans_s, lut.on(s.device))

    @staticmethod
    def softmax_fwd(x, scale, rpe, kp, attn, lut: Lut):
        x = x.contiguous()
        return cuda_op().softmax_fwd(x, scale, rpe, kp, attn, lut.on(x.device), lut.num_heads)

    @staticmethod
    def softmax_bwd(y, dy, scale, lut: Lut):
        return cuda_op().softmax_bwd(y, dy.contiguous(), scale, lut.on(y.device), lut.num_heads)


def path_for(t: torch.Tensor) -> Any:
    if t.device.type == "cpu":
        return CPUPath
    if t.device.type == "cuda" and _cuda_available():
        return CUDAPath
    return TorchPath


def to_dense(x: torch.Tensor, lut: Lut, fill: float = 0.0) -> torch.Tensor:
    """[b, nnz, block, block] -> [b, heads, nb*block, nb*block], `fill` outside the layout."""
    b = x.shape[0]
    dense = x.new_full((b, lut.num_heads, lut.nb, lut.nb, lut.block, lut.block), fill)
    dense[:, lut.heads, lut.rows, lut.cols] = x
    side = lut.nb * lut.block
    return dense.permute(0, 1, 2, 4, 3, 5).reshape(b, lut.num_heads, side, side)


def from_dense(x: torch.Tensor, lut: Lut) -> torch.Tensor:
    """[b, heads, nb*block, nb*block] -> the layout's blocks, [b, nnz, block, block]."""
    b = x.shape[0]
    blocks = x.reshape(b, lut.num_heads, lut.nb, lut.block, lut.nb, lut.block)
    return blocks.permute(0, 1, 2, 4, 3, 5)[:, lut.heads, lut.rows, lut.cols]

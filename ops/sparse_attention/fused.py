"""Fused block-sparse attention on CUDA ([Note: fused block-sparse attention] in
csrc/sparse_attention/sparse_flash.cu): softmax(scale q k^T + key bias over the layout) v in
one kernel, and its backward in two, without writing the scores. SparseSelfAttention takes
this path when the softmax has nothing else to add (no rpe or attention mask; a key padding
mask is fine) and the kernels take the operands."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepspeed_ext.accelerator.cuda import CUDAAccelerator

from . import kernels
from .lut import Tiles

FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_BLOCKS = (16, 32, 64, 128)
FUSED_HEAD_DIMS = (64, 128)
_CUDA = CUDAAccelerator()


def applies(query: torch.Tensor, block: int) -> bool:
    """Whether the fused kernels run these operands: 16-bit CUDA tensors on sm_80 or later, a
    layout block of 16 to 128, head_dim 64 or 128, and the CUDA op built."""
    if query.device.type != "cuda" or query.dtype not in FUSED_DTYPES:
        return False
    if block not in FUSED_BLOCKS or query.shape[-1] not in FUSED_HEAD_DIMS:
        return False
    if _CUDA.compute_capability(query.device.index)[0] < 8:
        return False
    return kernels._cuda_available()


def _aligned(t: torch.Tensor, to: int = 16) -> torch.Tensor:
    """The kernels load 16 bytes of q, k, v (8 of the key bias) at a time; a view that starts
    elsewhere is copied. (A traced graph has no addresses: there the op's own check names such
    an input.)"""
    if torch.compiler.is_compiling():
        return t
    return t if t.data_ptr() % to == 0 else t.clone()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: Tiles,
    scale: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch, heads, seq, head_dim] attention over `tiles`' layout, fused (see `applies`).
    key_bias ([batch, seq], fp32) is added to every score of its key after scaling: a key
    padding mask made additive (softmax.additive). Operands shorter than the tiles (a finer
    layout over a partial last tile) are padded with rows that take no part."""
    seq, pad = q.shape[-2], tiles.seq - q.shape[-2]
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    q, k, v = (_aligned(t.contiguous()) for t in (q, k, v))
    if key_bias is not None:
        key_bias = key_bias.to(q.device, torch.float32)
        key_bias = _aligned((F.pad(key_bias, (0, pad)) if pad else key_bias).contiguous(), 8)
    lut = tiles.lut
    o, _lse = kernels.cuda_op().flash_fwd(
        q, k, v, lut.on(q.device), lut.block, scale, tiles.mask_on(q.device), key_bias
    )
    return o[..., :seq, :] if pad else o

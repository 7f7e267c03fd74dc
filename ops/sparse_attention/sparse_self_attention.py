"""SparseSelfAttention (upstream's module of that name): scaled dot-product attention over a
sparsity layout, for query/key/value of [batch, heads, seq, head_dim]."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import fused
from .lut import Tiles, check_block, tiles_for
from .matmul import MatMul
from .softmax import Softmax, additive
from .sparsity_config import SparsityConfig


class SparseSelfAttention(nn.Module):
    """Attention restricted to `sparsity_config`'s layout. The layout is made once, for
    max_seq_length, and shorter sequences use its top-left corner (as upstream does).
    key_padding_mask ([batch, seq]) and attn_mask ([seq, seq]) are added ('add') or, for
    'mul', 0 marks what is masked out.

    Without rpe or attn_mask, 16-bit CUDA operands run fused (fused.applies), with or without
    a key padding mask: one kernel forward, two backward, no scores in memory. Setting
    `fused = False` keeps the unfused ops."""

    master_layout: torch.Tensor

    def __init__(
        self,
        sparsity_config: SparsityConfig | None = None,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
    ) -> None:
        super().__init__()
        self.sparsity_config = sparsity_config or SparsityConfig(num_heads=4)
        for name, mode in (
            ("key_padding_mask_mode", key_padding_mask_mode),
            ("attn_mask_mode", attn_mask_mode),
        ):
            if mode not in ("add", "mul"):
                raise ValueError(f"{name}={mode!r}: expected 'add' or 'mul'")
        check_block(self.sparsity_config.block)  # at construction, not at the first forward
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        # a buffer, as upstream's: state dicts carry the (possibly random) layout trained with
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self._ops: dict[int, tuple[MatMul, Softmax, MatMul]] = {}
        self._tiles: dict[int, Tiles] = {}
        self.fused = True

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._ops.clear()  # made from the layout the load replaced
        self._tiles.clear()

    def _fresh(self) -> None:
        """Drop the ops and tiles made from the layout if it was edited in place since
        (master_layout.copy_(...): its version counter moved)."""
        if torch.compiler.is_compiling():
            return  # traced: the eager calls before it made the ops
        version = self.master_layout._version
        if getattr(self, "_layout_version", version) != version:
            self._ops.clear()
            self._tiles.clear()
        self._layout_version = version

    def get_layout(self, seq_len: int) -> torch.Tensor:
        block = self.sparsity_config.block
        if seq_len % block:
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of the block size {block}; pad it "
                "(SparseAttentionUtils.pad_to_block_size)"
            )
        n = seq_len // block
        return self.master_layout[:, :n, :n]

    def get_tiles(self, seq_len: int) -> Tiles:
        """The fused kernels' tiles for seq_len, made once (checking and hashing a layout costs
        more than the kernels at 16k tokens, and torch.compile cannot trace it)."""
        self._fresh()
        if seq_len not in self._tiles:
            self._tiles[seq_len] = tiles_for(self.get_layout(seq_len), self.sparsity_config.block)
        return self._tiles[seq_len]

    def get_ops(self, heads: int, seq_len: int) -> tuple[MatMul, Softmax, MatMul]:
        self._fresh()
        if seq_len not in self._ops:
            layout, block = self.get_layout(seq_len), self.sparsity_config.block
            self._ops[seq_len] = (
                MatMul(layout, block, "sdd", trans_a=False, trans_b=True),
                Softmax(layout, block),
                MatMul(layout, block, "dsd"),
            )
        return self._ops[seq_len]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if query.dim() != 4:
            raise ValueError(
                f"query has shape {tuple(query.shape)}; expected [batch, heads, seq, head_dim]"
            )
        bsz, heads, seq, head_dim = query.shape
        kinds = (torch.float32, torch.bfloat16, torch.float16)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dtype not in kinds:
                raise TypeError(
                    f"SparseSelfAttention: {name} has dtype {t.dtype}; the block-sparse kernels "
                    "take float32, bfloat16 or float16: cast the inputs (e.g. .float())"
                )
        if seq == 0 or head_dim == 0:
            raise ValueError(
                f"query has shape {tuple(query.shape)}: the sequence and head_dim must not be empty"
            )
        if heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {heads} heads but the sparsity config was made for "
                f"num_heads={self.sparsity_config.num_heads}"
            )
        if seq > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_length={self.max_seq_length}; raise "
                "max_seq_length"
            )
        if key.shape[-1] == seq and key.shape[-2] != seq:  # given as [b, h, head_dim, seq]
            key = key.transpose(-1, -2)
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != (bsz, heads, seq, head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; query has {tuple(query.shape)}"
                )
        if key_padding_mask is not None:
            key_padding_mask = _key_padding(key_padding_mask, bsz, seq)
        if attn_mask is not None:
            attn_mask = _attention_mask(attn_mask, seq)
        scale = float(head_dim) ** -0.5
        block = self.sparsity_config.block
        if rpe is None and attn_mask is None and self.fused and fused.applies(query, block):
            bias = additive(key_padding_mask, self.key_padding_mask_mode, "key_padding_mask")
            return fused.attention(query, key, value, self.get_tiles(seq), scale, bias)
        sdd, softmax, dsd = self.get_ops(heads, seq)
        scores = sdd(query, key)
        probs = softmax(
            scores,
            scale=scale,
            rpe=rpe,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            key_padding_mask_mode=self.key_padding_mask_mode,
            attn_mask_mode=self.attn_mask_mode,
        )
        return dsd(probs, value)


def _key_padding(mask: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
    """[batch, seq], or with size-1 dims between ([batch, 1, 1, seq] as BERT extends it), as
    [batch, seq]. Checked by shape, not element count: a [seq, batch] mask would be taken
    apart into the wrong positions."""
    shape = tuple(mask.shape)
    if len(shape) < 2 or shape[0] != bsz or shape[-1] != seq or any(d != 1 for d in shape[1:-1]):
        raise ValueError(
            f"key_padding_mask has shape {shape}; expected [batch, seq] = [{bsz}, {seq}] "
            f"(or [{bsz}, 1, 1, {seq}])"
        )
    return mask.reshape(bsz, seq)


def _attention_mask(mask: torch.Tensor, seq: int) -> torch.Tensor:
    """[seq, seq], or with leading size-1 dims ([1, 1, seq, seq]), as [seq, seq]: one mask
    for every batch row and head, as upstream's."""
    shape = tuple(mask.shape)
    if len(shape) < 2 or shape[-2:] != (seq, seq) or any(d != 1 for d in shape[:-2]):
        raise ValueError(
            f"attn_mask has shape {shape}; expected [seq, seq] = [{seq}, {seq}] (or "
            f"[1, 1, {seq}, {seq}]): one mask for all batch rows and heads. Per-row padding "
            "goes in key_padding_mask; per-head patterns in the sparsity layout"
        )
    return mask.reshape(seq, seq)

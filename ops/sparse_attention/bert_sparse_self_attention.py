"""BertSparseSelfAttention (upstream's module of that name): BERT's self-attention with the
scores restricted to a sparsity layout. query/key/value projections as BERT's, then
SparseSelfAttention; the attention mask is a key-padding mask."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import FixedSparsityConfig, SparsityConfig


def key_padding(mask: torch.Tensor | None, batch: int, seq: int) -> torch.Tensor | None:
    """A BERT attention mask as a key-padding mask [batch, seq] (additive, or bool True =
    attend): a [b, s] mask (floating: additive, as upstream passes it on; bool or integer,
    a tokenizer's 0/1: 1 = attend), HF's extended [b, 1, 1, s], and the [b, 1, s, s] masks
    today's transformers builds, whose query rows must then all be the same."""
    if mask is None:
        return None
    if mask.dim() == 2:
        if mask.dtype.is_floating_point:
            return mask  # additive (0 = attend, -10000 = padding)
        return mask != 0  # 1 = attend
    if mask.dim() == 4 and mask.shape[0] == batch and mask.shape[-1] == seq:
        if mask.shape[2] > 1 and not bool((mask == mask[:, :, :1, :]).all()):
            raise ValueError(
                "BertSparseSelfAttention takes a key-padding mask; this attention mask differs "
                "between queries (causal or per-query), which the layout must express instead"
            )
        return mask[:, 0, 0, :]
    raise ValueError(
        f"attention_mask has shape {tuple(mask.shape)}; expected [{batch}, {seq}], "
        f"[{batch}, 1, 1, {seq}] or [{batch}, 1, {seq}, {seq}]"
    )


class BertSparseSelfAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        sparsity_config: SparsityConfig | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        """max_seq_length: the longest sequence (a multiple of the block); by default the
        config's max_position_embeddings."""
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size={config.hidden_size} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        sparsity_config = sparsity_config or FixedSparsityConfig(
            num_heads=config.num_attention_heads
        )
        if sparsity_config.num_heads != config.num_attention_heads:
            raise ValueError(
                f"the sparsity config has num_heads={sparsity_config.num_heads} but the model "
                f"has num_attention_heads={config.num_attention_heads}"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        max_len: int = max_seq_length or int(getattr(config, "max_position_embeddings", 2048))
        if max_len % sparsity_config.block:
            where = "max_seq_length" if max_seq_length else "config.max_position_embeddings"
            raise ValueError(
                f"{where}={max_len} is not a multiple of the sparsity block "
                f"{sparsity_config.block}: the layout covers whole blocks; pass max_seq_length= "
                "a multiple of it (the longest sequence after pad_to_block_size)"
            )
        self.sparse_self_attention = SparseSelfAttention(
            sparsity_config, key_padding_mask_mode="add", max_seq_length=max_len
        )

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q, k, v = (
            self.transpose_for_scores(proj(hidden_states))
            for proj in (self.query, self.key, self.value)
        )
        kp = key_padding(attention_mask, b, s)
        if kp is not None and kp.dtype != torch.bool:
            kp = kp.float()  # additive, as HF builds it
        ctx = self.sparse_self_attention(q, k, v, key_padding_mask=kp)
        return ctx.permute(0, 2, 1, 3).reshape(b, s, self.all_head_size)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """The same, called as today's transformers calls a BERT/RoBERTa self-attention: keyword
    arguments, and (context, attention weights) back (no weights: None)."""

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if encoder_hidden_states is not None:
            raise ValueError("sparse self-attention replaces self-attention, not cross-attention")
        if kwargs.get("output_attentions"):
            raise ValueError("sparse attention keeps no dense attention weights to output")
        return super().forward(hidden_states, attention_mask), None

"""SparseAttentionUtils (upstream's helpers): fit a Hugging Face BERT/RoBERTa model and its
inputs to sparse attention: longer position embeddings, self-attention replaced by
BertSparseSelfAttention (the trained q/k/v weights kept), inputs padded to the block size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .bert_sparse_self_attention import HFBertSparseSelfAttention
from .sparsity_config import SparsityConfig


def _encoder_of(model: Any) -> tuple[str, Any]:
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in ("bert", "roberta") and hasattr(model, "encoder"):
        return kind, model
    raise ValueError(
        f"{type(model).__name__} is neither a BERT nor a RoBERTa model (nor has one as .bert "
        "or .roberta); only those are supported"
    )


class SparseAttentionUtils:
    @staticmethod
    def extend_position_embedding(model: Any, max_position: int) -> Any:
        """Position embeddings for max_position tokens: the trained ones repeated (RoBERTa's
        first two, its padding offset, kept once)."""
        kind, enc = _encoder_of(model)
        emb = enc.embeddings.position_embeddings
        old = emb.weight.detach()
        offset = 2 if kind == "roberta" else 0
        total = max_position + offset
        if total <= old.shape[0]:
            raise ValueError(
                f"max_position={max_position} does not extend the {old.shape[0] - offset} "
                "positions the model has"
            )
        new = torch.empty(total, old.shape[1], dtype=old.dtype, device=old.device)
        new[:offset] = old[:offset]
        body = old[offset:]
        for start in range(offset, total, body.shape[0]):
            n = min(body.shape[0], total - start)
            new[start : start + n] = body[:n]
        enc.embeddings.position_embeddings = nn.Embedding.from_pretrained(new, freeze=False)
        if hasattr(enc.embeddings, "position_ids"):
            ids = torch.arange(total, device=old.device).expand(1, -1)
            enc.embeddings.register_buffer("position_ids", ids, persistent=False)
        if hasattr(enc.embeddings, "token_type_ids"):
            tt = torch.zeros(1, total, dtype=torch.long, device=old.device)
            enc.embeddings.register_buffer("token_type_ids", tt, persistent=False)
        model.config.max_position_embeddings = total
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: Any, max_position: int, sparsity_config: SparsityConfig | None = None
    ) -> Any:
        kind, enc = _encoder_of(model)
        # RoBERTa's position table has 2 more rows than positions (padding_idx + 1 offset),
        # as extend_position_embedding leaves it: the config keeps counting those rows
        model.config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, enc.encoder.layer, sparsity_config, max_position
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config: Any,
        layers: Any,
        sparsity_config: SparsityConfig | None = None,
        max_seq_length: int | None = None,
    ) -> Any:
        for layer in layers:
            old = layer.attention.self
            new = HFBertSparseSelfAttention(config, sparsity_config, max_seq_length).to(
                old.query.weight.device, old.query.weight.dtype
            )
            new.query, new.key, new.value = old.query, old.key, old.value  # trained weights
            layer.attention.self = new
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        pad_token_id: int,
        model_embeddings: Any,
    ) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pads the sequence to a multiple of block_size (padded keys masked out); returns
        (pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)."""
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
        ref: torch.Tensor = input_ids if input_ids is not None else inputs_embeds  # type: ignore[assignment]
        batch, seq = ref.shape[0], ref.shape[1]
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

        def pad(t: torch.Tensor | None, value: int) -> torch.Tensor | None:
            if t is None:
                return None
            return nn.functional.pad(t, (0, pad_len), value=value)

        if inputs_embeds is not None:
            ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=ref.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(ids)], dim=1)
        if attention_mask is None:
            attention_mask = torch.ones(batch, seq, dtype=torch.long, device=ref.device)
        return (
            pad_len,
            pad(input_ids, pad_token_id),
            pad(attention_mask, 0),  # padded keys are masked out
            pad(token_type_ids, 0),
            pad(position_ids, pad_token_id),
            inputs_embeds,
        )

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output

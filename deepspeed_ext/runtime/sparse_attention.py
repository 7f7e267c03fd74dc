"""[Note: sparse attention from the config]
A `sparse_attention` section in the config turns block-sparse self-attention on, with the
layout it describes (deepspeed.ops.sparse_attention's classes, one per mode). Upstream only
parses the section for the user's code to read (`DeepSpeedConfig.sparse_attention`); here the
engine acts on it before anything else touches the model, so the key is never a silent no-op:
- a model that already has SparseSelfAttention modules keeps them, when each one's layout is
  the section's (else an error names the module and both layouts);
- a Hugging Face BERT or RoBERTa model gets its self-attention replaced (the trained q/k/v
  projections kept), as SparseAttentionUtils does;
- any other model is refused: there is no attention the engine knows how to make sparse.
Sequences must then be a multiple of the block: SparseAttentionUtils.pad_to_block_size."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.ops.sparse_attention import SparseAttentionUtils, SparseSelfAttention
from deepspeed_ext.ops.sparse_attention.sparsity_config import (
    SparsityConfig,
    same_layout,
    sparsity_config_from_dict,
)
from deepspeed_ext.utils.logging import logger


def _describe(c: SparsityConfig) -> str:
    args = ", ".join(f"{k}={v}" for k, v in vars(c).items() if k != "num_layout_heads")
    return f"{type(c).__name__}({args})"


def _hf_config(model: torch.nn.Module) -> Any:
    """The config of a Hugging Face BERT/RoBERTa model, or None for any other model."""
    cfg: Any = getattr(model, "config", None)
    return cfg if getattr(cfg, "model_type", None) in ("bert", "roberta") else None


def apply(model: torch.nn.Module, config: Any) -> None:
    section = config.sparse_attention
    if section is None:
        return
    args = section.layout_args()
    existing = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseSelfAttention)]
    for name, module in existing:
        want = sparsity_config_from_dict(args, module.sparsity_config.num_heads)
        if not same_layout(module.sparsity_config, want):
            raise ValueError(
                f"sparse_attention: the model's SparseSelfAttention '{name}' uses "
                f"{_describe(module.sparsity_config)}, but the config asks for "
                f"{_describe(want)}; build the module from the section "
                "(deepspeed.ops.sparse_attention.sparsity_config_from_dict), or remove the "
                "section"
            )
    if existing:
        logger.info(
            f"sparse_attention: the model's {len(existing)} SparseSelfAttention module(s) use "
            f"the config's {args['mode']} layout"
        )
        return
    hf_config = _hf_config(model)
    if hf_config is None:
        raise ValueError(
            f"sparse_attention is set, but {type(model).__name__} has no self-attention the "
            "engine can make sparse (Hugging Face BERT/RoBERTa self-attention, or "
            "deepspeed.ops.sparse_attention.SparseSelfAttention modules); remove the section, "
            "or build the model with SparseSelfAttention"
        )
    layout = sparsity_config_from_dict(args, int(hf_config.num_attention_heads))
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, int(hf_config.max_position_embeddings), layout
    )
    layers = sum(isinstance(m, SparseSelfAttention) for m in model.modules())
    logger.info(
        f"sparse_attention: {layers} self-attention layer(s) of {type(model).__name__} now use "
        f"block-sparse attention, {_describe(layout)}; pad sequences to a multiple of "
        f"{layout.block}"
    )

"""Fused transformer layer (upstream's deepspeed.ops.transformer): a BERT encoder layer over
the kernels of [Note: transformer kernels] (csrc/transformer), C++ on the CPU."""

from .config import DeepSpeedTransformerConfig, TransformerConfig
from .kernels import dropout_keep_mask
from .layer import DeepSpeedTransformerLayer

__all__ = [
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "TransformerConfig",
    "dropout_keep_mask",
]

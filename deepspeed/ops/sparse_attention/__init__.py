from deepspeed_ext.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    MatMul,
    Softmax,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
)

from . import sparsity_config

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "MatMul",
    "Softmax",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "sparsity_config",
]

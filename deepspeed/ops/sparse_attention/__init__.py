from deepspeed_ext.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    MatMul,
    Softmax,
    SparseAttentionUtils,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)

from . import sparsity_config

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "MatMul",
    "Softmax",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "sparsity_config_from_dict",
    "sparsity_config",
]

"""Block-sparse attention (upstream's deepspeed.ops.sparse_attention): the sparsity layouts,
the block-sparse MatMul and Softmax ([Note: block-sparse kernels] in csrc/sparse_attention),
and SparseSelfAttention over them."""

from .bert_sparse_self_attention import BertSparseSelfAttention
from .matmul import MatMul
from .softmax import Softmax
from .sparse_attention_utils import SparseAttentionUtils
from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "MatMul",
    "Softmax",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "sparsity_config_from_dict",
]

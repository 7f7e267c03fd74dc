from deepspeed_ext.ops.sparse_attention.sparse_self_attention import SparseSelfAttention

__all__ = ["SparseSelfAttention"]

from deepspeed_ext.ops.sparse_attention.matmul import MatMul

__all__ = ["MatMul"]

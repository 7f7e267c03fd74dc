from deepspeed_ext.ops.sparse_attention.softmax import Softmax

__all__ = ["Softmax"]

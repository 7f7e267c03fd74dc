"""deepspeed.module_inject.layers: the column- and row-parallel layers AutoTP puts in place."""

from deepspeed_ext.tp.layers import LinearAllreduce, LinearLayer

__all__ = ["LinearAllreduce", "LinearLayer"]

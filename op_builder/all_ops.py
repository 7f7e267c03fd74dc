"""Registry of every op builder, by name (what ds_report and setup.py iterate)."""

from __future__ import annotations

from .async_io import AsyncIOBuilder
from .builder import OpBuilder
from .cpu_adagrad import CPUAdagradBuilder
from .cpu_adam import CPUAdamBuilder
from .cpu_lion import CPULionBuilder
from .huffman import HuffmanBuilder
from .packbits import PackBitsBuilder
from .sparse_attention import SparseAttnBuilder
from .transformer import TransformerBuilder

ALL_OPS: dict[str, type[OpBuilder]] = {
    b.NAME: b
    for b in (
        CPUAdamBuilder,
        CPUAdagradBuilder,
        CPULionBuilder,
        PackBitsBuilder,
        HuffmanBuilder,
        AsyncIOBuilder,
        TransformerBuilder,
        SparseAttnBuilder,
    )
}


def register(builder: type[OpBuilder]) -> None:
    ALL_OPS[builder.NAME] = builder


def _register_cuda_ops() -> None:
    try:
        from .fused_adam import FusedAdamBuilder
        from .fused_lamb import FusedLambBuilder
        from .fused_lion import FusedLionBuilder
        from .packbits_cuda import PackBitsCudaBuilder
        from .sparse_attention_cuda import SparseAttnCudaBuilder
        from .transformer_cuda import TransformerCudaBuilder
    except ImportError:  # pragma: no cover - files land with the CUDA ops
        return
    register(FusedAdamBuilder)
    register(FusedLambBuilder)
    register(FusedLionBuilder)
    register(PackBitsCudaBuilder)
    register(SparseAttnCudaBuilder)
    register(TransformerCudaBuilder)


_register_cuda_ops()

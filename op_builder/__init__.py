"""Op builders: declarative descriptions of the C++/CUDA ops and their JIT/prebuilt loading.

Layer 1: imports only the standard library at import time (torch lazily inside load()).
"""

from .all_ops import ALL_OPS
from .async_io import AsyncIOBuilder
from .builder import Compat, CPUOpBuilder, CUDAOpBuilder, OpBuilder, cache_root
from .cpu_adagrad import CPUAdagradBuilder
from .cpu_adam import CPUAdamBuilder
from .cpu_lion import CPULionBuilder
from .errors import OpBuildError

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CPUOpBuilder",
    "CUDAOpBuilder",
    "Compat",
    "OpBuildError",
    "OpBuilder",
    "cache_root",
]

"""Async file I/O for ZeRO-Infinity's NVMe offload: torch.ops.ds_async_io.aio_handle(...).

Upstream builds this op against libaio; ours uses io_uring through its raw system calls where
the kernel offers it and a pread/pwrite thread pool where not, both with O_DIRECT (csrc/aio/),
so it needs only Linux and a C++ compiler (no liburing, no libaio).
"""

from __future__ import annotations

import os
import platform
import shutil

from .builder import Compat, OpBuilder


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    SOURCES = (
        "aio/aio_file.cpp",
        "aio/aio_uring.cpp",
        "aio/aio_engine.cpp",
        "aio/aio_pool.cpp",
        "aio/aio_uring_engine.cpp",
        "bindings/aio.cpp",
    )
    INCLUDES = ("includes", ".")

    def is_compatible(self, verbose: bool = False) -> Compat:
        if platform.system() != "Linux":
            return Compat(f"needs Linux (pread/pwrite with O_DIRECT), not {platform.system()}")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return Compat("no C++ compiler found (install g++ or set CXX)")
        return Compat()

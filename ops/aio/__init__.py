"""Async file I/O (the NVMe tier of ZeRO-Infinity): upstream's aio_handle API.

    handle = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8)
    handle.async_pwrite(tensor, "/nvme/x.swp")   # returns 0 at once
    handle.wait()                                # -> 1 (ops completed), or raises
    i = handle.submit_pread(tensor, "/nvme/x.swp")  # deepspeed_ext's own: the request's id
    handle.wait_op(i)                            # waits for that request alone, or raises

Buffers are CPU tensors, contiguous, of any dtype; memory that does not start on a page is
bounced through aligned buffers by the op itself (new_cpu_locked_tensor gives memory that
needs no bounce). Errors name the file and the errno. Set DS_AIO_DIRECT=0 to skip O_DIRECT.

The I/O runs on io_uring where the kernel offers it (handle.backend() == "io_uring"), else on
a pread/pwrite thread pool ("threads", with handle.backend_reason() saying why, printed once).
Set DS_AIO_IO_URING=0 to ask for the thread pool.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from deepspeed_ext.op_builder import AsyncIOBuilder


class AioHandle(Protocol):
    """The methods of torch.classes.ds_async_io.AioHandle (csrc/bindings/aio.cpp)."""

    def get_block_size(self) -> int: ...
    def get_queue_depth(self) -> int: ...
    def get_single_submit(self) -> bool: ...
    def get_overlap_events(self) -> bool: ...
    def get_intra_op_parallelism(self) -> int: ...
    def get_alignment(self) -> int: ...
    def get_thread_count(self) -> int: ...
    def pending_ops(self) -> int: ...
    def buffered_reason(self) -> str: ...
    def backend(self) -> str: ...
    def backend_reason(self) -> str: ...
    def pread(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool,
        async_op: bool,
        file_offset: int = 0,
    ) -> int: ...
    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: str,
        validate: bool,
        async_op: bool,
        file_offset: int = 0,
    ) -> int: ...
    def read(
        self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0
    ) -> int: ...
    def write(
        self, buffer: torch.Tensor, filename: str, validate: bool, file_offset: int = 0
    ) -> int: ...
    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def wait(self) -> int: ...
    # deepspeed_ext's own: the request's id, for wait_op(id), which waits for it alone
    def submit_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def submit_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int: ...
    def wait_op(self, op_id: int) -> int: ...
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: torch.Tensor
    ) -> torch.Tensor: ...
    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool: ...


def aio_handle(
    block_size: int = 1048576,
    queue_depth: int = 8,
    single_submit: bool = False,
    overlap_events: bool = False,
    intra_op_parallelism: int = 1,
) -> AioHandle:
    """A new handle (loads, and on first use builds, the async_io op)."""
    op = AsyncIOBuilder().load()
    handle = op.aio_handle(
        block_size=block_size,
        queue_depth=queue_depth,
        single_submit=single_submit,
        overlap_events=overlap_events,
        intra_op_parallelism=intra_op_parallelism,
    )
    return cast(AioHandle, handle)


__all__ = ["AioHandle", "AsyncIOBuilder", "aio_handle"]

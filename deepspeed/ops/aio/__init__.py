from deepspeed_ext.ops.aio import AioHandle, AsyncIOBuilder, aio_handle

__all__ = ["AioHandle", "AsyncIOBuilder", "aio_handle"]

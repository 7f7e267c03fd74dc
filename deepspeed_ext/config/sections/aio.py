"""`aio`: the asynchronous I/O engine that ZeRO-Infinity's NVMe offload uses."""

from __future__ import annotations

from pydantic import Field

from ..types import Bool, Int, Section


class AioConfig(Section):
    block_size: Int = Field(default=1_048_576, ge=1)
    queue_depth: Int = Field(default=8, ge=1, le=65536)
    # Upstream's old name: thread_count (aliases.py).
    intra_op_parallelism: Int = Field(default=1, ge=1)
    single_submit: Bool = False
    overlap_events: Bool = True
    # NVIDIA GPUDirect Storage (CUDA only).
    use_gds: Bool = False

    def active(self) -> bool:
        return False  # tunes NVMe offload; nothing to switch on by itself

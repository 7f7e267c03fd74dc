"""Rank function for the clean-exit test (importable by spawned ranks)."""

from __future__ import annotations

import gc
import os


def threads_around_destroy() -> tuple[int, int]:
    """Thread count before and after the exit-time destroy, with an optimizer built (which
    imports torch.distributed.nn through torch._dynamo) after the group came up."""
    import torch
    import torch.distributed as dist

    from deepspeed_ext.comm import init as comm_init

    comm_init.init_distributed(verbose=False)
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    t = torch.ones(8)
    dist.all_reduce(t, async_op=True).wait()
    before = len(os.listdir("/proc/self/task"))
    comm_init._destroy_at_exit()
    gc.collect()
    return before, len(os.listdir("/proc/self/task"))

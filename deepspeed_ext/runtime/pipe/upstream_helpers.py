"""Small public helpers of upstream's PipelineEngine that code written for it calls: the dtype
id tables, get_additional_losses(), and the two print helpers, log_for_device (off unless a
debugging user sets the module switches) and tput_log (rank 0, every steps_per_print)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext import comm

# upstream's module switches for log_for_device: the stage and data-parallel id that print
# (-1: every one; -2: none, the default). Read from this module and from upstream's path.
LOG_STAGE = -2
DATA_PARALLEL_ID = -2
_UPSTREAM_PATH = "deepspeed.runtime.pipe.engine"


def _switch(name: str) -> int:
    ours = int(globals()[name])
    theirs = getattr(sys.modules.get(_UPSTREAM_PATH), name, -2)
    return ours if ours != -2 else int(theirs)


class PipeUpstreamHelpers:
    # upstream's order: the ids its engine sent in shape messages (kept for code that maps
    # dtypes through them; this engine's messages carry their own codes)
    ID_TO_DTYPE = [
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.float16,
        torch.bfloat16,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    ]
    DTYPE_TO_ID = {dtype: i for i, dtype in enumerate(ID_TO_DTYPE)}

    if TYPE_CHECKING:  # the engine's
        stage_id: int
        grid: Any
        global_steps: int
        agg_additional_losses: Any

        def steps_per_print(self) -> int | None: ...

    def get_additional_losses(self) -> Any:
        """This batch's additional losses, averaged (agg_additional_losses)."""
        return self.agg_additional_losses

    def log_for_device(self, *msg: Any) -> None:
        """Print msg, prefixed with where it comes from, on the stage and data-parallel id
        that LOG_STAGE and DATA_PARALLEL_ID select (set on this module or upstream's path)."""
        stage, data = _switch("LOG_STAGE"), _switch("DATA_PARALLEL_ID")
        if stage not in (-1, self.stage_id):
            return
        if data not in (-1, self.grid.data_parallel_id):
            return
        print(
            f"RANK={comm.get_rank()} PIPE-ID={self.stage_id} "
            f"DATA-ID={self.grid.data_parallel_id} STEP-ID={self.global_steps} ::",
            *msg,
            flush=True,
        )

    def tput_log(self, *msg: Any) -> None:
        """Print msg on global rank 0 at every steps_per_print-th step."""
        every = self.steps_per_print()
        if comm.get_rank() == 0 and every and self.global_steps % every == 0:
            print(*msg, flush=True)

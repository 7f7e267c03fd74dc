"""The gradient-strategy protocol: what the engine, the optimizer step and checkpoints may
call on stage 0, ZeRO 1/2 and ZeRO 3 alike, and the one context they are built from.

[Note: gradient strategy]
A strategy owns where gradients live and how they are reduced over the data-parallel group,
and what the optimizer steps (fp32 masters, whole or partitioned). The engine's calls, in
order: attach_optimizer(opt) once; per micro-step begin_backward(boundary), backward, and
end_backward() (also queued as an autograd callback, so a plain loss.backward() leaves
nothing pending: [Note: end of backward]); on a boundary the optimizer step
(runtime/optimizer_step.py) calls grad_sq_sum(), scale_grads_(f), before_step(),
optimizer_step(opt), after_step(), then zero_grads().

Checkpoints hold what the strategy says: model_state() goes into the model-states file
(written by data-parallel rank 0 of each model-parallel rank), rank_state() into this rank's
zero_pp_rank_* file (None: no per-rank file); loading hands them back, with the rank files of
the saved data-parallel ranks readable through RankFiles (a resume at another data-parallel
size reads them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from deepspeed_ext.comm import MEAN, AxisGroup, GradAverage

if TYPE_CHECKING:
    from .named_state import NamedState


@dataclass(frozen=True)
class StrategyContext:
    module: torch.nn.Module
    model_groups: list[dict[str, Any]]  # the model's param groups (params + options)
    accum_dtype: torch.dtype  # gradient accumulation dtype
    bucket_numel: int  # elements per reduction bucket
    device: torch.device  # where the model computes
    optimizer_device: torch.device  # where masters and optimizer states live
    data: AxisGroup  # the data-parallel group (comm/layout.py)
    global_rank: int  # unique per process: names per-process files (NVMe swap)
    zero: Any = None  # the zero_optimization config section
    aio: dict[str, Any] = field(default_factory=dict)  # the aio config section
    # whether the micro-step under way ends an accumulation window: asked when a backward
    # the engine did not begin (a plain loss.backward()) produces its first gradient
    is_boundary: Callable[[], bool] = lambda: True
    averaging: GradAverage = MEAN  # mean or sum, and where the division happens
    # stage 0: replaces the buckets' all-reduce by a compressed mean (gradient_compression);
    # called with the flat buckets, keeps per-rank state (state_dict / load_state_dict)
    grad_exchange: Any = None
    # stage 0: each gradient bucket's sum by node (comm.NodeGroups; [Note: hierarchical
    # all-reduce]), None: one flat all-reduce
    hierarchy: Any = None
    # the dtype gradients are reduced in ([Note: communication dtype]); None: accum_dtype
    comm_dtype: torch.dtype | None = None


def offloaded(ctx: StrategyContext) -> bool:
    """The optimizer runs on the host (offload_optimizer to cpu or nvme)."""
    off = getattr(ctx.zero, "offload_optimizer", None)
    return str(getattr(off, "device", "none") or "none") in ("cpu", "nvme")


class RankFiles(Protocol):
    where: Path  # the checkpoint directory, for messages

    def read(self, dp_rank: int) -> dict[str, Any]:
        """The zero_pp_rank file of a saved data-parallel rank (this model-parallel rank)."""
        ...

    def has(self, dp_rank: int) -> bool:
        """Whether the saving run had data-parallel rank dp_rank (its file exists)."""
        ...


class GradientStrategy(Protocol):
    stage: int
    sync_enabled: bool  # False inside engine.no_sync()
    mixed_grads_ok: bool  # the optimizer takes 16-bit grads for fp32 masters
    partitioned_grads: bool  # each data-parallel rank holds part of the reduced gradients

    def optimizer_param_groups(self) -> list[dict[str, Any]]: ...
    def repoint(self, optimizer: torch.optim.Optimizer) -> None: ...
    def attach_optimizer(self, optimizer: Any) -> None: ...
    def begin_backward(self, boundary: bool) -> None: ...
    def end_backward(self) -> None: ...
    def grad_sq_sum(self) -> torch.Tensor: ...
    def scale_grads_(self, factor: float) -> None: ...
    def before_step(self) -> None: ...
    def optimizer_step(self, optimizer: Any) -> None: ...
    def after_step(self) -> None: ...
    def zero_grads(self) -> None: ...
    def remove_hooks(self) -> None: ...
    # the reduced gradient storage of exactly these params (a whole param group at ZeRO 1/2:
    # this rank's chunks of it), laid out the same on every rank holding the same params in
    # the same group: pipeline tied weights sum it over their tie group
    def grads_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]: ...
    def sync_masters_from_model(self) -> None: ...
    def model_state(self, optimizer: Any, exclude_frozen: bool) -> dict[str, Any]: ...
    def rank_state(self, optimizer: Any) -> dict[str, Any] | None: ...
    def load_model_state(self, state: dict[str, Any], strict: bool, files: RankFiles) -> None: ...
    def load_optimizer_state(
        self, optimizer: Any, state: dict[str, Any], files: RankFiles
    ) -> None: ...
    # optimizer state by parameter name, from any layout ([Note: named optimizer state])
    def load_named_state(self, optimizer: Any, named: NamedState, where: Any) -> None: ...

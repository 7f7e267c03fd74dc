"""deepspeed.zero.GatheredParameters: full parameters inside a `with` block.

With modifier_rank=r, what rank r changed in place is broadcast on exit, every rank keeps its
new shard, and the optimizer's fp32 master of each changed trainable parameter follows (so
a weight loaded inside the block is what training continues from).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from deepspeed_ext.comm import group_broadcast

from .gather import gather_params, release_params
from .param import is_zero_param, own_slice, step_pending, write_shard


def _as_list(params: Any) -> list[Any]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        return [p for p in params if p is not None]
    raise TypeError(f"GatheredParameters takes a parameter or an iterable of them, not {params!r}")


class GatheredParameters:
    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: Any = None,
        enabled: bool = True,
    ) -> None:
        self.params = [p for p in _as_list(params) if is_zero_param(p)] if enabled else []
        # a parameter listed twice is gathered and counted once
        self.params = list({id(p): p for p in self.params}.values())
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module

    def __enter__(self) -> GatheredParameters:
        for p in self.params:
            p.ds_active += 1
        gather_params(self.params)
        # a forward inside the block whose backward comes after it: autograd keeps the
        # whole parameter, which the exit releases; its backward then names it instead of
        # failing on an empty storage
        self._saved: Any = None
        if self.params and torch.is_grad_enabled():
            self._saved = torch.autograd.graph.saved_tensors_hooks(*_released_check(self.params))
            self._saved.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
        try:
            # also when the block raised, as upstream: a parameter kept whole between steps
            # (persistent) was left edited on the modifier rank alone, the ranks disagreeing
            if self.modifier_rank is not None:
                self._scatter_changes()
        finally:
            for p in self.params:
                p.ds_active -= 1
            release_params(self.params)

    @torch.no_grad()
    def _scatter_changes(self) -> None:
        # an update deferred by an engine.step() inside the context ([Note: optimizer steps
        # in forward]) lands before the change, which then wins, as it does without deferral
        step_pending(self.params)
        groups = {(p.dtype, id(p.ds_process_group)): p.ds_process_group for p in self.params}
        for (dtype, gid), dp in groups.items():
            same = [p for p in self.params if p.dtype == dtype and id(p.ds_process_group) == gid]
            flat = torch.cat([p.data.reshape(-1) for p in same])
            # modifier_rank counts within the data-parallel group (the whole world without
            # model parallelism)
            group_broadcast(flat, dp, int(self.modifier_rank))  # type: ignore[arg-type]
            rank, world = dp.rank, dp.size
            off = 0
            for p in same:
                full = flat[off : off + p.ds_numel]
                off += p.ds_numel
                p.data.copy_(full.view(p.ds_shape))
                write_shard(p, own_slice(full, rank, world))
                sync = getattr(p, "ds_master_sync", None)
                if sync is not None:
                    sync()


class _Kept:
    """A saved gathered parameter (autograd saves an alias of it, which the release empties
    with it): the tensor, and the parameter to look at in backward."""

    def __init__(self, tensor: torch.Tensor, param: Any) -> None:
        self.tensor = tensor
        self.param = param


def _released_check(params: list[Any]) -> tuple[Any, Any]:
    by_ptr = {p.data_ptr(): p for p in params if p.numel()}

    def pack(t: torch.Tensor) -> Any:
        if t.layout is not torch.strided or t.is_meta or isinstance(t, FakeTensor):
            return t  # no storage to match (sparse, meta, traced)
        p = by_ptr.get(t.data_ptr())
        return _Kept(t, p) if p is not None and t.shape == p.shape else t

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Kept):
            return saved
        p = saved.param
        if p.numel() == 0 and p.ds_numel:
            raise RuntimeError(
                f"ZeRO-3 parameter {p.ds_name} (shape {tuple(p.ds_shape)}) was gathered by "
                "deepspeed.zero.GatheredParameters for a forward whose backward ran after the "
                "block released it: register it with deepspeed.zero.register_external_parameter"
                "(module, param) so the engine gathers it for both passes, or run the backward "
                "inside the block"
            )
        return saved.tensor

    return pack, unpack

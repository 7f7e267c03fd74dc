"""Strict access (a debugging aid): with DS_ZERO3_STRICT=1, a torch operation that reads a
partitioned parameter while it is released raises an error naming the parameter, instead of
computing on the empty tensor a released parameter holds (upstream's silent 0-element
results and shape errors far from the cause).

Partitioned parameters are given a Parameter subclass whose __torch_function__ checks its
arguments; property access (.data, .shape, .grad, ...) and dtype/device moves stay allowed
(the engine moves released parameters), so only real reads are caught. It costs a Python
call per operation on a parameter, so it is off unless asked for.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .param import ZeroParamStatus

_ALLOWED = frozenset(
    {
        "__get__",
        "__set__",
        "__delete__",
        "__repr__",
        "__format__",
        "__reduce_ex__",
        "__deepcopy__",
        "to",
        "cpu",
        "cuda",
        "half",
        "float",
        "bfloat16",
        "double",
        "type",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_has_compatible_shallow_copy_type",
        "is_floating_point",
        "is_complex",
        "element_size",
    }
)


class PartitionedParameterAccessError(RuntimeError):
    pass


def enabled() -> bool:
    return os.environ.get("DS_ZERO3_STRICT", "0") not in ("", "0")


def _released(t: Any) -> bool:
    status = getattr(t, "ds_status", ZeroParamStatus.AVAILABLE)
    return isinstance(t, StrictZeroParameter) and status is not ZeroParamStatus.AVAILABLE


class StrictZeroParameter(torch.nn.Parameter):
    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _ALLOWED:
            for a in (*args, *kwargs.values()):
                items = a if isinstance(a, (list, tuple)) else (a,)
                for t in items:
                    if _released(t):
                        name = getattr(t, "ds_name", f"ds_id {t.ds_id}")
                        raise PartitionedParameterAccessError(
                            f"{getattr(func, '__name__', func)} read ZeRO-3 parameter '{name}' "
                            f"(shape {tuple(t.ds_shape)}) while it is partitioned: only its "
                            "1/world shard is on this rank. Read it inside "
                            "`with deepspeed.zero.GatheredParameters([param]):` (add "
                            "modifier_rank=0 to write it), or from a module's forward"
                        )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def make_strict(p: torch.nn.Parameter, name: str | None = None) -> None:
    if name is not None:
        p.ds_name = name  # type: ignore[attr-defined]
    if type(p) is torch.nn.Parameter:
        p.__class__ = StrictZeroParameter

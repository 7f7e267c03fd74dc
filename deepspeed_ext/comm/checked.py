"""torch.distributed as the comm layer calls it. The comm layer is the only torch.distributed
user; through this one door every tensor handed to a collective is checked first: the tensor
an all-reduce, broadcast or reduce works in place on, or a point-to-point one, must be
contiguous (gloo moves such a tensor's storage as if it were dense, silently: a broadcast of
a sliced batch delivered other elements; gloo's point-to-point refuses it with a terse
message); torch copies into and out of the other collectives' views itself, so those pass.
With device-strict mode on ([Note: device-strict mode] in accelerator/strict.py), a host
tensor over a device group is refused, as NCCL would refuse it on a GPU."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as _td

from deepspeed_ext.accelerator import strict

from . import waits
from .comms_logging import comms_logger, timed_call

_TENSOR_OPS = frozenset(
    "all_reduce broadcast all_gather all_gather_into_tensor all_gather_single reduce_scatter "
    "reduce_scatter_tensor reduce_scatter_single all_to_all_single all_to_all reduce "
    "gather scatter "
    "send recv isend irecv".split()
)
# Groups made with backend="gloo" beside the default one: host groups (a GPU run keeps its
# small host-side checks on them), so host tensors are right there.
_host_groups: list[Any] = []


def is_host_group(group: Any) -> bool:
    return any(group is g for g in _host_groups)


def is_dense(t: torch.Tensor) -> bool:
    """Contiguous, or channels-last contiguous (which NCCL takes too)."""
    if t.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


# the ops whose one tensor must be dense (the module docstring says why)
_DENSE_OPS = frozenset("all_reduce broadcast reduce send recv isend irecv".split())


def _check_dense(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    t = args[0] if args else kwargs.get("tensor")
    if isinstance(t, torch.Tensor) and not is_dense(t):
        raise ValueError(
            f"{op}: a non-contiguous tensor (shape {tuple(t.shape)}, strides {t.stride()}); "
            "gloo would move the wrong elements without an error: pass t.contiguous() (and "
            "copy the result back where it must land in place)"
        )


def _checked(name: str, fn: Any, logged: bool = True) -> Any:
    dense = name in _DENSE_OPS

    def call(*args: Any, **kwargs: Any) -> Any:
        if dense:
            _check_dense(name, args, kwargs)
        if strict.active():
            strict.check_collective(
                name, list(args) + list(kwargs.values()), not is_host_group(kwargs.get("group"))
            )
        t0 = time.perf_counter()
        if logged and comms_logger.wants(name):
            n = _td.get_world_size(kwargs.get("group")) if _td.is_initialized() else 1
            out = timed_call(name, fn, args, kwargs, n)
        else:
            out = fn(*args, **kwargs)
        if out is not None and (kwargs.get("async_op") or name in ("isend", "irecv")):
            return waits.TimedWork(out)  # [Note: compute time]: its wait() is counted
        waits.add(time.perf_counter() - t0)
        return out

    return call


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int, Any, int]]) -> list[Any]:
    """torch's batch_isend_irecv of (name "isend" or "irecv", tensor, global peer, process
    group, tag) each, through the checks a single isend or irecv gets; their handles."""
    p2p = []
    for name, tensor, peer, group, tag in ops:
        _check_dense(name, (tensor,), {})
        if strict.active():
            strict.check_collective(name, [tensor], not is_host_group(group))
        p2p.append(_td.P2POp(getattr(_td, name), tensor, peer, group, tag))
    return [waits.TimedWork(w) for w in _td.batch_isend_irecv(p2p)]


def _new_group(*args: Any, **kwargs: Any) -> Any:
    group = _td.new_group(*args, **kwargs)
    if kwargs.get("backend") == "gloo":
        _host_groups.append(group)
    return group


class _Dist:
    """Forwards to torch.distributed; the tensor collectives go through the check.
    logged false: the comms logger does not see them, because they are the parts of one
    collective recorded whole (comms_logging.logical_call)."""

    def __init__(self, logged: bool = True) -> None:
        self._logged = logged

    def __getattr__(self, name: str) -> Any:
        fn = getattr(_td, name)
        if name in _TENSOR_OPS:
            return _checked(name, fn, self._logged)
        if name == "new_group":
            return _new_group
        return fn


dist: Any = _Dist()
parts: Any = _Dist(logged=False)


# torch 2.13 renamed the flat collectives (*_single) and warns on every call of the old names
ALL_GATHER_OP = (
    "all_gather_single" if hasattr(_td, "all_gather_single") else "all_gather_into_tensor"
)
REDUCE_SCATTER_OP = (
    "reduce_scatter_single" if hasattr(_td, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_into(out: Any, inp: Any, via: Any = dist, **kwargs: Any) -> Any:
    """Every rank's `inp` into `out` (concatenated in group-rank order): torch's single-tensor
    all-gather under the name this torch has. via: `parts` for one that the comms logger
    does not see (a part of a collective recorded whole)."""
    return getattr(via, ALL_GATHER_OP)(out, inp, **kwargs)

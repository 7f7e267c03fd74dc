"""Counting the functional ops as they run, by patching torch.nn.functional and torch.

[Note: functional patching]
As upstream's profiler does, the profiled functions are swapped for counting wrappers while a
profile runs, so any module (custom ones too) is counted by what it calls, not by its type.
A call made inside a counted call is not counted again (a patched function that calls another
one, e.g. a Python-level functional built on torch.matmul). A formula that cannot read its
arguments records the call as uncounted instead of breaking the model.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import _VF

from . import formulas as fm


class Sink(Protocol):
    def add(self, name: str, flops: int, macs: int) -> None: ...

    def uncounted_call(self, name: str) -> None: ...


_F_OPS: dict[str, Callable[..., fm.Count]] = {
    "linear": fm.linear,
    "conv1d": fm.conv,
    "conv2d": fm.conv,
    "conv3d": fm.conv,
    "conv_transpose1d": fm.conv_transpose,
    "conv_transpose2d": fm.conv_transpose,
    "conv_transpose3d": fm.conv_transpose,
    "relu": fm.elementwise,
    "prelu": fm.elementwise,
    "elu": fm.elementwise,
    "leaky_relu": fm.elementwise,
    "relu6": fm.elementwise,
    "silu": fm.elementwise,
    "gelu": fm.elementwise,
    "batch_norm": fm.batch_norm,
    "layer_norm": fm.layer_norm,
    "instance_norm": fm.instance_norm,
    "group_norm": fm.group_norm,
    "rms_norm": fm.rms_norm,
    "avg_pool1d": fm.pool,
    "avg_pool2d": fm.pool,
    "avg_pool3d": fm.pool,
    "max_pool1d": fm.pool,
    "max_pool2d": fm.pool,
    "max_pool3d": fm.pool,
    "adaptive_avg_pool1d": fm.pool,
    "adaptive_avg_pool2d": fm.pool,
    "adaptive_avg_pool3d": fm.pool,
    "adaptive_max_pool1d": fm.pool,
    "adaptive_max_pool2d": fm.pool,
    "adaptive_max_pool3d": fm.pool,
    "upsample": fm.upsample,
    "interpolate": fm.upsample,
    "softmax": fm.elementwise,
    "embedding": fm.none,
    "dropout": fm.none,
    "scaled_dot_product_attention": fm.attention,
}
_TORCH_OPS: dict[str, Callable[..., fm.Count]] = {
    "matmul": fm.matmul,
    "mm": fm.matmul,
    "bmm": fm.matmul,
    "addmm": fm.addmm,
    "baddbmm": fm.addmm,
    "mul": fm.binary,
    "add": fm.binary,
    "einsum": fm.einsum,
}
# what nn.LSTM, nn.GRU and nn.RNN call (torch's flop counter counts none of them on a CPU)
_VF_OPS: dict[str, Callable[..., fm.Count]] = {
    "lstm": fm.rnn,
    "gru": fm.rnn,
    "rnn_tanh": fm.rnn,
    "rnn_relu": fm.rnn,
}
# the same as methods (self is the first argument), and the @ operator
_TENSOR_OPS = {**{k: v for k, v in _TORCH_OPS.items() if k != "einsum"}, "__matmul__": fm.matmul}


class _State(threading.local):
    inside = False


_state = _State()
_sink: Sink | None = None
_saved: list[tuple[Any, str, Any]] = []


def _wrap(name: str, fn: Any, formula: Callable[..., fm.Count]) -> Any:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        sink = _sink
        if sink is None or _state.inside:
            return fn(*args, **kwargs)
        try:
            flops, macs = formula(*args, **kwargs)
        except Exception:  # a count is never worth breaking the model for
            sink.uncounted_call(name)
        else:
            sink.add(name, int(flops), int(macs))
        _state.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _state.inside = False

    return counted


def install(sink: Sink) -> None:
    """Route the profiled ops' counts to `sink` until `uninstall()`; one profile at a time."""
    global _sink
    if _sink is not None:
        raise RuntimeError(
            "a FLOPs profile is already running in this process; call end_profile() (or "
            "stop_profile()) on it before starting another"
        )
    owners = ((F, _F_OPS), (torch, _TORCH_OPS), (torch.Tensor, _TENSOR_OPS), (_VF, _VF_OPS))
    for owner, table in owners:
        for name, formula in table.items():
            fn = getattr(owner, name, None)
            if fn is None:
                continue
            _saved.append((owner, name, fn))
            setattr(owner, name, _wrap(name, fn, formula))
    _sink = sink


def uninstall() -> None:
    global _sink
    while _saved:
        owner, name, fn = _saved.pop()
        setattr(owner, name, fn)
    _sink = None


def installed() -> bool:
    return _sink is not None

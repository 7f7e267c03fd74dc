"""Device-strict mode: on a CPU-only machine, emulate the two rules a discrete accelerator
enforces, so code that would break on a GPU breaks in CPU tests too.

[Note: device-strict mode]
On a GPU, NCCL takes only device tensors, and a non_blocking device-to-host copy may still
be in flight when the host reads it. On the CPU both mistakes are invisible: every tensor is
a CPU tensor and every copy is complete on return. With DS_EXT_DEVICE_STRICT=1 (the test
suite sets it) each rank process tracks where a tensor *would* live on a GPU machine:

- host: made by a factory given no device (torch's default device is the CPU), by .cpu(),
  .pin_memory() or mark_host() (offload buffers declare themselves), and the out-of-place
  results of ops whose tensor inputs are all host. A device given explicitly, .to(device)
  and .cuda() make device tensors; tensors autograd makes (gradients) are device tensors.
- pending: the destination of a non_blocking copy from a device tensor into a host tensor
  (host.copy_(x, non_blocking=True), x.to(host, non_blocking=True)), until an event
  recorded after it is synchronized, or the accelerator synchronizes. Reading a pending
  tensor is an error. (x.to(torch.device("cpu")) names a device that, on a CPU machine, is
  the device too, so asynchronous copies to the host go into declared host buffers.)

The comm layer refuses host tensors handed to a collective over a device group (every group
but the gloo side groups made with backend="gloo"), as NCCL would. Tags live on the tensor
objects, so the check costs one Python call per torch op; it is off unless asked for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ENV = "DS_EXT_DEVICE_STRICT"
_HOST = "_ds_strict_host"
_PENDING = "_ds_strict_pending"

_FACTORIES = frozenset(
    "tensor as_tensor zeros ones empty full arange range linspace logspace rand randn "
    "randint randperm eye empty_strided scalar_tensor from_numpy frombuffer".split()
)
_LIKE = frozenset("zeros_like ones_like empty_like full_like rand_like randn_like".split())
_NEW = frozenset("new_zeros new_ones new_empty new_full new_tensor new_empty_strided".split())
# Reading these does not touch a tensor's values.
_METADATA = frozenset(
    "__get__ __set__ size dim numel stride storage_offset data_ptr element_size is_pinned "
    "is_contiguous untyped_storage nelement ndimension __len__ __hash__ __eq__ __repr__ "
    "record_stream".split()
)


class StrictDeviceError(RuntimeError):
    """Code that would fail (or race) on a GPU, found on the CPU."""


class _State:
    mode: TorchFunctionMode | None = None
    copies = 0  # async device-to-host copies issued (their epochs)
    synced = 0  # every copy up to this epoch is known complete


def requested() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


def active() -> bool:
    return _State.mode is not None


def is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, _HOST, False))


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Declare t a host buffer (an offload buffer): on a GPU machine it would be in host
    memory. Returns t."""
    if active():
        setattr(t, _HOST, True)
    return t


def unmark_host(t: torch.Tensor) -> torch.Tensor:
    """t now holds device memory again (offload_states' reload). Returns t."""
    if getattr(t, _HOST, False):
        delattr(t, _HOST)
    return t


def pending(t: torch.Tensor) -> bool:
    epoch = getattr(t, _PENDING, 0)
    return epoch > _State.synced


def record_epoch() -> int:
    """What an event records: the async copies issued so far."""
    return _State.copies


def synced_through(epoch: int | None = None) -> None:
    """Every async copy up to `epoch` (all of them: None) is complete."""
    _State.synced = max(_State.synced, _State.copies if epoch is None else epoch)


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _set(out: Any, host: bool) -> None:
    for t in _tensors([out]):
        if host:
            setattr(t, _HOST, True)
        elif getattr(t, _HOST, False):
            delattr(t, _HOST)


def _target(args: tuple, kwargs: dict) -> Any:
    """The device (or tensor) a .to() call names, None when it names a dtype only."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, torch.Tensor, int)) and not isinstance(a, bool):
            return a
    return None


class _Provenance(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        nonblocking = bool(kwargs.get("non_blocking", False))
        if _State.copies > _State.synced and name not in _METADATA and not nonblocking:
            for t in _tensors(args):
                if pending(t):
                    raise StrictDeviceError(
                        f"{name}() reads a tensor that a non_blocking device-to-host copy is "
                        "still writing (on a GPU it may be incomplete): record an event after "
                        "the copy and synchronize it, or synchronize the accelerator, first"
                    )
        out = func(*args, **kwargs)
        if name in _METADATA:
            return out
        if name in _FACTORIES:
            _set(out, kwargs.get("device") is None)
        elif name in _LIKE or name in _NEW:
            if kwargs.get("device") is None:
                _set(out, is_host(args[0]))
            else:
                _set(out, False)
        elif name in ("cpu", "pin_memory"):
            if out is not args[0]:  # on a CPU machine x.cpu() is x: a device tensor stays
                _set(out, True)
        elif name == "cuda":
            _set(out, False)
        elif name == "to":
            self._moved(args, kwargs, out, nonblocking)
        elif name == "copy_":
            src = args[1] if len(args) > 1 else kwargs["src"]
            if nonblocking and is_host(args[0]) and not is_host(src):
                _State.copies += 1
                setattr(args[0], _PENDING, _State.copies)
        elif not name.endswith("_") or name.startswith("__"):
            ins = _tensors(args)
            if ins and not name.startswith("__i"):
                _set(out, all(is_host(t) for t in ins))
        return out

    @staticmethod
    def _moved(args: tuple, kwargs: dict, out: Any, nonblocking: bool) -> None:
        src = args[0]
        target = _target(args, kwargs)
        if target is None:
            _set(out, is_host(src))
            return
        # a device named by an object or string is the device: on a CPU machine the host
        # and the device are both "cpu", so only a host tensor names the host
        host = isinstance(target, torch.Tensor) and is_host(target)
        if not (host and out is src):  # x.to(device) is x on a CPU machine: declared there
            _set(out, host)
        if nonblocking and host and not is_host(src):
            _State.copies += 1
            setattr(out, _PENDING, _State.copies)


def install() -> bool:
    """Turn strict mode on in this process (and thread) when DS_EXT_DEVICE_STRICT asks for
    it and the accelerator is the CPU (a real GPU enforces the rules itself). Idempotent."""
    if active() or not requested():
        return active()
    from . import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    mode = _Provenance()
    mode.__enter__()  # for the life of the process: never exited
    _State.mode = mode
    return True


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Strict mode for a block of this thread (tests of the rules themselves)."""
    if active():
        yield
        return
    mode = _Provenance()
    _State.mode = mode
    try:
        with mode:
            yield
    finally:
        _State.mode = None


def check_collective(op: str, tensors: Iterable[Any], device_group: bool) -> None:
    """What NCCL would refuse: a host tensor, or one still being copied, in a collective
    over a device group."""
    if not active():
        return
    for t in _tensors(tensors):
        if pending(t):
            raise StrictDeviceError(
                f"{op}: a tensor still being written by a non_blocking copy handed to a "
                "collective; wait for the copy's event first"
            )
        if device_group and is_host(t):
            raise StrictDeviceError(
                f"{op}: a host tensor ({t.dtype}, shape {tuple(t.shape)}) handed to a "
                "collective over a device group; NCCL takes only device tensors: create it "
                "on the collective's device (deepspeed_ext.comm.collective_device(group))"
            )

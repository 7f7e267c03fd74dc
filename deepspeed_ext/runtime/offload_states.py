"""engine.offload_states() / reload_states() (upstream's names and arguments): move the
training states to host memory between training phases (generation in RLHF, say) and back.

[Note: offloading states]
Upstream moves each ZeRO buffer it knows of and re-derives the views into it by hand. Here
the unit moved is a storage: each strategy names the tensors that root a kind of state
(state_roots(kind)), and every tensor in the process that views one of those storages
(found by a scan of the garbage collector's objects, parameters' .grad included) is
re-pointed at the host copy with its own offset, size and strides. Views stay views of one
another, and nothing that held a tensor needs to know it moved. A storage still referenced
after the move (a view the scan cannot see, kept by C++ alone) would keep its device memory
and split from its copy: its use count says so, and the move is undone with an error rather
than left half done. The scan costs a pass over Python's objects (a fraction of a second),
fine for a call made between training phases. On a CPU accelerator the states move into
fresh host buffers (declared host in device-strict mode), which tests the same path.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch

from deepspeed_ext.accelerator import get_accelerator, strict


class OffloadStateTypeEnum(str, Enum):
    """The kinds of state (upstream's names)."""

    optim_states = "optim_states"  # the optimizer's per-parameter state (moments)
    hp_params = "hp_params"  # fp32 master weights, where they are a copy
    lp_params = "lp_params"  # the model's own weights (stage 3: this rank's shards)
    lp_grads = "lp_grads"  # gradients held between steps
    contiguous_grad_buffer = "contiguous_grad_buffer"  # gradient buckets


KINDS = tuple(OffloadStateTypeEnum)


def refine(include: Iterable[Any] | None, optimizer_on_host: bool) -> list[str]:
    """The kinds asked for as strings (all when None), without those already on the host:
    with offload_optimizer the masters and optimizer states live there (as upstream)."""
    names = [k.value for k in KINDS] if include is None else [_kind(k) for k in include]
    if optimizer_on_host:
        names = [k for k in names if k not in ("hp_params", "optim_states")]
    return list(dict.fromkeys(names))


def _kind(k: Any) -> str:
    value = k.value if isinstance(k, Enum) else str(k)
    if value not in {x.value for x in KINDS}:
        raise ValueError(
            f"offload_states: include has {k!r}; the kinds are "
            f"{', '.join(x.value for x in KINDS)} (OffloadStateTypeEnum)"
        )
    return value


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper's torch optimizer
    state = getattr(inner, "state", {})
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors the optimizer steps (fp32 masters, say), whose grads the scan must see."""
    return [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr() if s.nbytes() else None
    except (RuntimeError, NotImplementedError):  # sparse, meta, fake or functional tensors
        return None


def _views_of(keys: set[int], extra: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """Every tensor object that views one of these storages (by data pointer)."""
    found: dict[int, dict[int, torch.Tensor]] = {k: {} for k in keys}
    for obj in [*gc.get_objects(), *extra]:
        # type(), not isinstance: some module objects warn when their __class__ is read
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            k = _storage_key(obj)
            if k in found:
                found[k][id(obj)] = obj
    return {k: list(v.values()) for k, v in found.items()}


def _grads(module: torch.nn.Module, more: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters' gradients as Python objects, so the scan sees them."""
    params = [*module.parameters(), *more]
    return [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]


def _repoint(t: torch.Tensor, storage: torch.UntypedStorage, device: torch.device) -> None:
    new = torch.empty(0, dtype=t.dtype, device=device)
    new.set_(storage, t.storage_offset(), t.size(), t.stride())
    t.data = new


def on_host(t: torch.Tensor) -> bool:
    """Already in host memory: a CPU tensor on a GPU machine; on a CPU accelerator, one
    declared host (device-strict mode) or moved here before."""
    if t.device.type != "cpu":
        return False
    return get_accelerator().device_name() != "cpu" or strict.is_host(t)


def move(
    roots: list[torch.Tensor],
    to: torch.device,
    to_host: bool,
    pin: bool,
    non_blocking: bool,
    module: torch.nn.Module,
    extra: list[torch.Tensor],
) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """Moves every storage the roots view to `to`; returns (new storage, old device) pairs.
    Raises (with everything put back) when an old storage stays referenced."""
    keys: dict[int, torch.UntypedStorage] = {}
    for t in roots:
        k = _storage_key(t)
        if k is not None:
            keys.setdefault(k, t.untyped_storage())
    if not keys:
        return []
    views = _views_of(set(keys), [*extra, *_grads(module, extra)])
    acc = get_accelerator()
    out: list[tuple[torch.UntypedStorage, torch.device]] = []
    # (tensor, its old storage and device, whether it was declared host), to undo the move
    done: list[tuple[torch.Tensor, torch.UntypedStorage, torch.device, bool]] = []
    kept = 0
    for k, old in keys.items():
        src = torch.empty(0, dtype=torch.uint8, device=old.device).set_(old)
        dst = torch.empty(old.nbytes(), dtype=torch.uint8, device=to)
        if pin and to.type == "cpu" and old.device.type != "cpu":
            dst = acc.pin_memory(dst)
        dst.copy_(src, non_blocking=non_blocking)
        new = dst.untyped_storage()
        del src, dst
        for t in views[k]:
            done.append((t, old, old.device, strict.is_host(t)))
            _repoint(t, new, to)
            strict.mark_host(t) if to_host else strict.unmark_host(t)
        out.append((new, old.device))
        # what still holds the old storage, past our own handle: a view the scan missed
        kept += torch._C._storage_Use_Count(old._cdata) > 1
    views.clear()
    if kept:
        _undo(done)
        raise RuntimeError(
            f"offload_states: {kept} storage(s) stay referenced by tensors Python cannot "
            "see, so their memory would not be freed; nothing was moved"
        )
    if non_blocking and to.type == "cpu":
        acc.synchronize()  # the host copies must be whole before anything reads them
    return out


def _undo(done: list[tuple[torch.Tensor, torch.UntypedStorage, torch.device, bool]]) -> None:
    for t, old, device, was_host in done:
        _repoint(t, old, device)
        strict.mark_host(t) if was_host else strict.unmark_host(t)


class Offloaded:
    """What one offload_states moved: the kinds, and each storage with its home device."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.storages: list[tuple[torch.UntypedStorage, torch.device]] = []


def offload(
    held: Offloaded,
    kinds: list[str],
    roots_of: Any,
    optimizer: Any,
    module: torch.nn.Module,
    pin_memory: bool,
    non_blocking: bool,
) -> None:
    """Moves the kinds not moved yet to the host; roots_of(kind) names each kind's tensors."""
    todo = [k for k in kinds if k not in held.kinds]
    roots: list[torch.Tensor] = []
    for k in todo:
        roots += optimizer_state_tensors(optimizer) if k == "optim_states" else roots_of(k)
    roots = [t for t in roots if t is not None and not on_host(t)]
    extra = _optimizer_params(optimizer)
    cpu = torch.device("cpu")
    held.storages += move(roots, cpu, True, pin_memory, non_blocking, module, extra)
    held.kinds += todo
    get_accelerator().empty_cache()


def reload(held: Offloaded, optimizer: Any, module: torch.nn.Module, non_blocking: bool) -> None:
    """Moves every storage offload() moved back to the device it came from."""
    extra = _optimizer_params(optimizer)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for storage, device in held.storages:
        root = torch.empty(0, dtype=torch.uint8).set_(storage)
        by_device.setdefault(device, []).append(root)
    held.storages.clear()
    for device, roots in by_device.items():
        move(roots, device, False, False, non_blocking, module, extra)
    held.kinds.clear()

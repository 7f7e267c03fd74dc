"""The partitioned parameter (ZeRO stage 3).

[Note: stage-3 parameter]
Every parameter keeps its identity (modules, optimizers and user code hold the same object);
only its `.data` changes. A parameter of N elements on W ranks is cut into W equal flat shards
of S = ceil(N / W) elements, the last one zero-padded; rank r keeps shard r as `ds_tensor`.
While released, `.data` is an empty tensor of the same dtype; while gathered, it is a view of
`ds_flat` ([W*S], the all-gather's own output, so a big parameter needs no copy). Releasing
also resizes ds_flat's storage to 0 bytes, and gathering resizes it back: autograd saves
views of the weight (`weight.t()` for a linear), which keep that one storage alive, so the
memory is really freed between forward and backward, and the re-gather before the module's
backward refills exactly what backward reads (FSDP2 frees the same way).

Attributes (upstream's names, which transformers and accelerate read):
  ds_id      int, unique per process, equal across ranks (construction order)
  ds_shape   torch.Size of the full parameter;  ds_numel: its element count
  ds_tensor  [S] this rank's shard (model dtype; on the CPU with param offload)
  ds_status  ZeroParamStatus
  ds_persist bool: small parameters stay gathered (stage3_param_persistence_threshold)
  ds_process_group  the data-parallel AxisGroup it is partitioned over (comm/layout.py)
"""

from __future__ import annotations

import itertools
import math
from enum import Enum
from typing import Any

import torch


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # .data is the full parameter
    NOT_AVAILABLE = 2  # .data is empty; ds_tensor holds this rank's shard
    INFLIGHT = 3  # an all-gather into it is under way


class ZeroParamType(Enum):
    NORMAL = 1  # a plain parameter
    PARTITIONED = 2  # partitioned over the data-parallel ranks (every one here)
    REMOTE = 3  # upstream: held by one rank only (not used here)


_ids = itertools.count()


def is_zero_param(p: Any) -> bool:
    return hasattr(p, "ds_id")


def shard_numel(numel: int, world: int) -> int:
    return max(1, math.ceil(numel / world))


def own_slice(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of a full flat tensor, padded with zeros to S elements."""
    s = shard_numel(flat.numel(), world)
    out = torch.zeros(s, dtype=flat.dtype, device=flat.device)
    lo, hi = min(rank * s, flat.numel()), min((rank + 1) * s, flat.numel())
    out[: hi - lo].copy_(flat[lo:hi])
    return out


def empty_like_param(p: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=device if device is not None else p.device)


def convert(
    p: torch.nn.Parameter,
    group: Any,
    shard_device: torch.device,
    compute_device: torch.device,
    persist: bool,
    dtype: torch.dtype | None = None,
) -> None:
    """Turn a full parameter into a partitioned one (in place): its full value is kept as this
    rank's shard, and as a whole only if persistent. Callers make every rank's value equal
    first (a broadcast). group: the data-parallel AxisGroup to partition over."""
    p.ds_param_type = ZeroParamType.PARTITIONED  # type: ignore[attr-defined]
    rank, world = group.rank, group.size
    full = p.data.to(compute_device, dtype=dtype or p.dtype)
    p.ds_id = next(_ids)  # type: ignore[attr-defined]
    p.ds_process_group = group  # type: ignore[attr-defined]
    p.ds_shape = full.shape  # type: ignore[attr-defined]
    p.ds_numel = full.numel()  # type: ignore[attr-defined]
    p.ds_persist = persist  # type: ignore[attr-defined]
    p.ds_tensor = own_slice(full.reshape(-1), rank, world).to(shard_device)  # type: ignore[attr-defined]
    p.ds_shard_numel = p.ds_tensor.numel()  # type: ignore[attr-defined]  # S, even when swapped out
    p.ds_swap = None  # type: ignore[attr-defined]  # the NVMe swapper holding the shard, if any
    # called before the shard is read while its optimizer step is deferred ([Note: optimizer
    # steps in forward])
    p.ds_step_pending = None  # type: ignore[attr-defined]
    p.ds_device = compute_device  # type: ignore[attr-defined]  # where the full value lives
    p.ds_active = 0  # type: ignore[attr-defined]  # open forwards and gathers using it
    p.ds_handle = None  # type: ignore[attr-defined]  # the all-gather in flight, if INFLIGHT
    p.ds_name = getattr(p, "ds_name", f"ds_id {p.ds_id}")  # type: ignore[attr-defined]
    new_flat(p, compute_device, full.dtype, world)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
    if persist:
        ensure_storage(p)
        p.ds_flat[: p.ds_numel].copy_(full.reshape(-1))  # type: ignore[attr-defined]
        set_full(p)
    else:
        p.data = empty_like_param(full)
    _bind_methods(p)
    from .strict import enabled, make_strict

    if enabled():
        make_strict(p)


def read_shard(p: Any) -> torch.Tensor:
    """This rank's shard [S]; read back from NVMe when it was swapped out. Copy it before
    the next read_shard: a deferred step that the next read runs may reuse its memory
    ([Note: sub-group arenas]; step_pending runs such steps up front)."""
    step_pending([p])
    return p.ds_swap.fetch(p) if p.ds_swap is not None else p.ds_tensor


def step_pending(params: list[Any]) -> None:
    """The deferred optimizer steps of these shards ([Note: optimizer steps in forward]),
    run before any of them is read."""
    for p in params:
        if p.ds_step_pending is not None:
            p.ds_step_pending(p)


@torch.no_grad()
def write_shard(p: Any, value: torch.Tensor) -> None:
    """Store a new shard value (cast to the parameter's dtype), on NVMe when swapped out."""
    if p.ds_swap is not None:
        p.ds_swap.store(p, value.to(p.dtype))
    else:
        p.ds_tensor.copy_(value)


def new_flat(p: Any, device: torch.device, dtype: torch.dtype, world: int) -> None:
    """A [W*S] gather buffer whose storage holds nothing until the first gather."""
    p.ds_flat = torch.empty(world * p.ds_shard_numel, dtype=dtype, device=device)
    p.ds_flat.untyped_storage().resize_(0)


def ensure_storage(p: Any) -> None:
    storage = p.ds_flat.untyped_storage()
    need = p.ds_flat.numel() * p.ds_flat.element_size()
    if storage.nbytes() < need:
        storage.resize_(need)


def set_full(p: Any) -> None:
    """The gathered value (in ds_flat) becomes the parameter's data."""
    p.data = p.ds_flat[: p.ds_numel].view(p.ds_shape)
    p.ds_status = ZeroParamStatus.AVAILABLE


def release(p: torch.nn.Parameter) -> None:
    """Drop the full value (the shard stays): the memory of a released parameter is 1/W."""
    if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:  # type: ignore[attr-defined]
        p.data = empty_like_param(p.data)
        p.ds_flat.untyped_storage().resize_(0)  # type: ignore[attr-defined]
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]


def _bind_methods(p: torch.nn.Parameter) -> None:
    """Upstream's per-parameter methods, which some user code calls."""
    from .gather import gather_params, release_params  # the collectives sit a layer up

    def all_gather(param_list: list[Any] | None = None, async_op: bool = False) -> None:
        gather_params(param_list or [p])

    def partition(param_list: list[Any] | None = None, **_: Any) -> None:
        release_params(param_list or [p], force=True)

    def ds_summary() -> dict[str, Any]:
        return {
            "id": p.ds_id,  # type: ignore[attr-defined]
            "status": p.ds_status.name,  # type: ignore[attr-defined]
            "numel": p.ds_numel,  # type: ignore[attr-defined]
            "shape": tuple(p.ds_shape),  # type: ignore[attr-defined]
            "shard_numel": p.ds_shard_numel,  # type: ignore[attr-defined]
            "persist": p.ds_persist,  # type: ignore[attr-defined]
        }

    p.all_gather = all_gather  # type: ignore[attr-defined]
    p.partition = partition  # type: ignore[attr-defined]
    p.ds_summary = ds_summary  # type: ignore[attr-defined]

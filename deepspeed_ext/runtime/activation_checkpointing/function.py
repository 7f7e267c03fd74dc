"""checkpoint(): run a function without keeping its activations, and run it again in the
backward to get them.

[Note: activation checkpointing]
Reentrant (upstream's checkpoint): an autograd Function runs the function under no_grad,
keeping its inputs and a snapshot of every RNG stream (torch's CPU generator, the device's,
the tracker's named streams); its backward reruns it with grad on, from the same snapshot
(dropout draws the same masks) under the same autocast state, and backpropagates through
the rerun. A reentrant Function only reaches parameters through inputs that need grad, so
when none does (token ids into an embedding) checkpoint() takes the non-reentrant path
instead of returning outputs that silently lose the parameters' gradients (a known
torch.utils.checkpoint trap). Non-reentrant: torch's non-reentrant checkpoint, with the
tracker's streams replayed by its context hooks.
cpu_checkpointing keeps the saved inputs in host memory (pinned, copied asynchronously) and
copies them back for the recompute; on a CPU device they are host memory already and are
kept as they are. partition_activations keeps 1/tp of each ([Note: partitioned
checkpoints]); the non-reentrant path keeps them whole (said once).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from deepspeed_ext.accelerator import get_accelerator, strict
from deepspeed_ext.utils.logging import logger

from . import partition, rng, settings


def _sync() -> None:
    if settings.current().synchronize_checkpoint_boundary:
        get_accelerator().synchronize()


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    """synchronize_checkpoint_boundary and profile around a forward or a recompute."""
    s = settings.current()
    _sync()
    t0 = time.perf_counter() if s.profile else 0.0
    try:
        yield
    finally:
        _sync()
        if s.profile:
            if not s.synchronize_checkpoint_boundary:
                get_accelerator().synchronize()  # a time needs the work done
            s.times[name] += time.perf_counter() - t0
            s.calls[name] += 1


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.detach()
    acc = get_accelerator()
    buf = strict.mark_host(torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    buf = acc.pin_memory(buf)
    buf.copy_(t.detach(), non_blocking=True)  # read back by a device copy only: ordered
    return buf


_AUTOCAST_TYPES = ("cpu", "cuda")


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    out = []
    for dev in _AUTOCAST_TYPES:
        with contextlib.suppress(RuntimeError):
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return out


@contextlib.contextmanager
def _autocast(state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
        yield


class _Reentrant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], box: list[Any], *args: Any) -> Any:
        s = settings.current()
        ctx.run = run
        ctx.rng = rng.snapshot()
        ctx.autocast = _autocast_state()
        ctx.spec = [
            (isinstance(a, torch.Tensor), isinstance(a, torch.Tensor) and a.requires_grad)
            for a in args
        ]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.cpu = s.cpu_checkpointing
        axis = settings.tensor_axis(s.mpu) if s.partition_activations else None
        ctx.axis = axis if axis is not None and axis.size > 1 else None
        if ctx.axis is not None:  # [Note: partitioned checkpoints]
            ctx.kept = [partition.split(t, ctx.axis) for t in tensors]
            if ctx.cpu:
                for k in ctx.kept:
                    if isinstance(k, partition.Part):
                        k.data = _to_host(k.data)
        elif ctx.cpu:
            ctx.devices = [t.device for t in tensors]
            ctx.host = [_to_host(t) for t in tensors]
            # a CPU input is kept as is, outside save_for_backward: its in-place check here
            ctx.versions = [h._version for h in ctx.host]
        else:
            ctx.save_for_backward(*tensors)
        with _phase("forward"), torch.no_grad():
            out = run(*args)
        box.append(out)
        flat = _outputs(out)
        tensors_out = tuple(o for o in flat if isinstance(o, torch.Tensor))
        ctx.mark_non_differentiable(*[t for t in tensors_out if not t.is_floating_point()])
        return tensors_out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            # its inner backward fills every parameter's .grad, which torch.autograd.grad
            # and backward(inputs=...) promise to leave alone (as torch's reentrant refuses)
            raise RuntimeError(
                "deepspeed.checkpointing.checkpoint (reentrant) cannot run under "
                "torch.autograd.grad() or backward(inputs=...): its recompute's backward would "
                "write every parameter's .grad. Use "
                "deepspeed.checkpointing.non_reentrant_checkpoint there, or .backward() "
                "without inputs"
            )
        if ctx.axis is not None:
            saved = [partition.join(k, ctx.axis) for k in ctx.kept]
            ctx.kept = None
        elif ctx.cpu:
            _check_unmodified(ctx.host, ctx.versions)
            saved = [h.to(d, non_blocking=True) for h, d in zip(ctx.host, ctx.devices)]
        else:
            saved = list(ctx.saved_tensors)
        it = iter(saved)
        inputs = []
        for (is_t, req), other in zip(ctx.spec, ctx.others):
            inputs.append(next(it).detach().requires_grad_(req) if is_t else other)
        with (
            _phase("recompute"),
            rng.replaying(ctx.rng),
            _autocast(ctx.autocast),
            torch.enable_grad(),
        ):
            out = ctx.run(*inputs)
        outs = [o for o in _outputs(out) if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (
            None,
            None,
            *[x.grad if is_t and req else None for x, (is_t, req) in zip(inputs, ctx.spec)],
        )


def _check_unmodified(kept: list[torch.Tensor], versions: list[int]) -> None:
    for i, (t, v) in enumerate(zip(kept, versions)):
        if t._version != v:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: input {i} of a checkpointed function (shape "
                f"{tuple(t.shape)}) changed after its forward; the recompute would read the "
                "new values. Modify a copy instead"
            )


def _outputs(out: Any) -> list[Any]:
    """The output's leaves: nested tuples, lists, dicts and registered containers (Hugging
    Face's ModelOutput) included. A Function returns tensors alone; a tensor one level down
    left out of them would lose its gradient silently (as torch's reentrant checkpoint's)."""
    return pytree.tree_leaves(out)


def _rebuild(out: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    """The function's own output structure, its tensors replaced by the graph's."""
    leaves, spec = pytree.tree_flatten(out)
    it = iter(tensors)
    return pytree.tree_unflatten(
        [next(it) if isinstance(o, torch.Tensor) else o for o in leaves], spec
    )


def _positional(function: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    if not kwargs:
        return function, args
    keys, n = tuple(kwargs), len(args)

    def call(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(keys, all_args[n:])))

    return call, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Upstream's deepspeed.checkpointing.checkpoint ([Note: activation checkpointing])."""
    run, flat = _positional(function, args, kwargs)
    if not torch.is_grad_enabled():
        return run(*flat)  # no backward will come: nothing to save or recompute
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat):
        return non_reentrant_checkpoint(run, *flat)
    box: list[Any] = []
    tensors = _Reentrant.apply(run, box, *flat)
    return _rebuild(box[0], tensors)


class _Recompute:
    """The recompute context: every random stream (CPU, device, tracker) as at the forward.
    torch restores the device's stream only for devices among the inputs, which cpu_checkpointing
    has moved to the host, so the snapshot is taken here. Re-enterable, because
    torch enters the one object at every recompute, and a split backward (zb-h1: input
    gradients first, weight gradients later) recomputes twice."""

    def __init__(self, saved: dict[str, Any]) -> None:
        self.saved = saved
        self.open: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(rng.replaying(self.saved["rng"]))
        stack.enter_context(_phase("recompute"))
        self.open.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.open.pop().__exit__(*exc))


def _tracker_contexts() -> tuple[Any, Any]:
    saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved["rng"] = rng.snapshot()
        with _phase("forward"):
            yield

    return forward(), _Recompute(saved)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Upstream's non_reentrant_checkpoint: works when no input needs grad, and with
    backward hooks and torch.autograd.grad ([Note: activation checkpointing])."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    run, flat = _positional(function, args, kwargs)
    if settings.current().cpu_checkpointing:
        run, flat = _via_host(run, flat)
    if settings.current().partition_activations:
        _say_whole_once()
    return torch_checkpoint(
        run, *flat, use_reentrant=False, preserve_rng_state=True, context_fn=_tracker_contexts
    )


_said_whole = False


def _say_whole_once() -> None:
    """torch's non-reentrant checkpoint owns its saved inputs, so they cannot be split; the
    reentrant path (checkpoint() with an input needing grad) splits them."""
    global _said_whole
    if not _said_whole:
        logger.info(
            "activation_checkpointing.partition_activations: a non-reentrant checkpoint "
            "(no input needing grad, or non_reentrant_checkpoint) keeps its inputs whole"
        )
        _said_whole = True


def _via_host(run: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], tuple]:
    """cpu_checkpointing for the non-reentrant path: the checkpoint keeps host copies of the
    device inputs (the gradient still flows back through the copies)."""
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
    if all(d is None or d.type == "cpu" for d in devices):
        return run, args
    host = tuple(
        a.to("cpu") if isinstance(a, torch.Tensor) and a.device.type != "cpu" else a for a in args
    )

    def call(*xs: Any) -> Any:
        back = [x.to(d, non_blocking=True) if d is not None else x for x, d in zip(xs, devices)]
        return run(*back)

    return call, host

"""Random-number state for recomputation: upstream's tracker of named device RNG states
(Megatron's model-parallel dropout stream), and snapshots that make a recompute draw the
same random numbers (dropout masks) as the forward it replays.

On the CPU the accelerator's generator is torch's CPU generator, so the tracker forks that
one there: the same code runs, and replays exactly, on either.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.accelerator import get_accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"  # upstream's tracker name


class CudaRNGStatesTracker:
    """Named device RNG states. add(name, seed) creates one; fork(name) runs a block drawing
    from it (then keeps its advanced state) and restores the default stream after."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a state named {name!r} exists already")
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.manual_seed(seed)
        self.states_[name] = acc.get_rng_state()
        acc.set_rng_state(before)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(
                f"RNG tracker: no state named {name!r}; call "
                "deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed) first"
            )
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            acc.set_rng_state(before)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def _tp_rank(mpu: Any) -> int:
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


def model_parallel_cuda_manual_seed(seed: int, mpu: Any = None) -> None:
    """The default device stream gets `seed` (the same on every tensor-parallel rank: dropout
    outside tensor-parallel regions agrees), the tracker's model-parallel stream gets
    seed + 2718 + the tensor-parallel rank (upstream's offsets, so seeds match its runs)."""
    from . import settings

    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + _tp_rank(mpu or settings.current().mpu))


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the model-parallel stream (upstream's name and offsets)."""
    from . import settings

    with _TRACKER.fork():
        get_accelerator().manual_seed(seed + 2718 + _tp_rank(settings.current().mpu))


@dataclass
class RNGSnapshot:
    cpu: torch.Tensor
    device: torch.Tensor | None
    tracked: dict[str, torch.Tensor]


def snapshot() -> RNGSnapshot:
    acc = get_accelerator()
    device = acc.get_rng_state() if acc.device_name() != "cpu" else None
    return RNGSnapshot(torch.get_rng_state(), device, _TRACKER.get_states())


def restore(s: RNGSnapshot) -> None:
    torch.set_rng_state(s.cpu)
    if s.device is not None:
        get_accelerator().set_rng_state(s.device)
    _TRACKER.set_states(dict(s.tracked))


@contextlib.contextmanager
def replaying(s: RNGSnapshot) -> Iterator[None]:
    """Run a block drawing the random numbers it drew when `s` was taken; the streams
    continue afterwards as if the block had not run."""
    now = snapshot()
    restore(s)
    try:
        yield
    finally:
        restore(now)

"""FlopsProfiler: FLOPs, MACs, parameters and latency of a model and each of its modules.

Forward: the functional ops the model calls are counted as they run ([Note: functional
patching]) and charged to every module on the call stack, so a module's count includes its
children's. Backward: counted at the dispatcher as it runs (`count_backward`), recomputed
activations included, not assumed to be twice the forward.
A profile starts from zero each time (`start_profile` resets), so repeated profiles of the
same input give identical counts.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from deepspeed_ext.accelerator import get_accelerator

from . import patching
from .units import duration_to_string, macs_to_string, number_to_string, params_to_string

_counter_ready = False


def _warm_up_counter() -> None:
    """torch's FlopCounterMode sets itself up at its first op (about 1 s on a CPU): done
    once here, outside the timed pass, or the profiled forward's latency included it."""
    global _counter_ready
    if not _counter_ready:
        with FlopCounterMode(display=False):
            torch.ones(2, 2) @ torch.ones(2, 2)
        _counter_ready = True


@dataclass
class ModuleStats:
    params: int
    flops: int = 0
    macs: int = 0
    duration: float = 0.0  # seconds inside the module's forward, summed over calls
    calls: int = 0


@dataclass
class PassCount:
    """One pass counted at the dispatcher: matrix products, convolutions, attention."""

    flops: int = 0
    duration: float = 0.0


def _trainable_params(module: torch.nn.Module) -> int:
    # a ZeRO-3 partitioned parameter keeps its full size in ds_numel
    return sum(
        int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad
    )


class FlopsProfiler:
    def __init__(
        self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        # used only when the backward was not counted: then backward = (2 + factor) x forward
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.stats: dict[torch.nn.Module, ModuleStats] = {}
        self.op_flops: Counter[str] = Counter()  # per functional op, whole model
        self.uncounted: Counter[str] = Counter()  # calls whose arguments no formula read
        self.fwd_dispatch = PassCount()
        self.bwd: PassCount | None = None  # set by count_backward
        self.step_duration: float | None = None
        self._stack: list[ModuleStats] = []
        self._starts: list[float] = []
        self._handles: list[Any] = []
        self._sync = get_accelerator().synchronize
        # upstream's names, filled when the profile is printed
        self.flops = 0
        self.macs = 0
        self.params = 0

    # -- the patched ops report here ([Note: functional patching]) -----------------------------
    def add(self, name: str, flops: int, macs: int) -> None:
        if not self._stack:
            return  # outside the model (e.g. the loss in the training loop)
        self.op_flops[name] += flops
        for s in self._stack:
            s.flops += flops
            s.macs += macs

    def uncounted_call(self, name: str) -> None:
        if self._stack:
            self.uncounted[name] += 1

    # -- lifecycle -----------------------------------------------------------------------------
    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Reset, hook every module (except instances of `ignore_list` types, whose ops count
        toward their parent) and start counting."""
        if self.started:
            self.end_profile()
        self.reset_profile()
        ignore = tuple(ignore_list or ())
        self.stats = {
            m: ModuleStats(_trainable_params(m))
            for m in self.model.modules()
            if m is self.model or not (ignore and isinstance(m, ignore))
        }
        self.started = True
        self.resume_profile()

    def resume_profile(self) -> None:
        """Count again after stop_profile(), adding to the counts so far (the engine pauses
        between a step's forward passes, so that recomputation in backward is not counted as
        forward)."""
        if not self.started:
            raise RuntimeError("resume_profile() before start_profile()")
        if self._handles:
            return
        for module in self.stats:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        patching.install(self)

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until end_profile()."""
        if patching.installed():
            patching.uninstall()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack, self._starts = [], []

    def reset_profile(self) -> None:
        for s in self.stats.values():
            s.flops = s.macs = s.calls = 0
            s.duration = 0.0
        self.op_flops.clear()
        self.uncounted.clear()
        self.fwd_dispatch = PassCount()
        self.bwd = None
        self.step_duration = None

    def end_profile(self) -> None:
        self.stop_profile()
        self.stats = {}
        self.started = False

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        s = self.stats.get(module)
        if s is None:
            return
        self._sync()
        self._stack.append(s)
        self._starts.append(time.perf_counter())

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        s = self.stats.get(module)
        if s is None or not self._stack or self._stack[-1] is not s:
            return
        self._sync()
        s.duration += time.perf_counter() - self._starts.pop()
        s.calls += 1
        self._stack.pop()

    # -- dispatcher counts (the engine wraps its forward and backward) -------------------------
    @contextlib.contextmanager
    def count_forward_dispatch(self) -> Iterator[None]:
        with self._dispatch(self.fwd_dispatch):
            yield

    @contextlib.contextmanager
    def count_backward(self) -> Iterator[None]:
        """Count what the backward runs, recomputation included."""
        if self.bwd is None:
            self.bwd = PassCount()
        with self._dispatch(self.bwd):
            yield

    @contextlib.contextmanager
    def _dispatch(self, into: PassCount) -> Iterator[None]:
        _warm_up_counter()
        counter = FlopCounterMode(display=False)
        self._sync()
        t0 = time.perf_counter()
        with counter:
            yield
        self._sync()
        into.duration += time.perf_counter() - t0
        into.flops += int(counter.get_total_flops())

    # -- totals (upstream's getters) -----------------------------------------------------------
    def _root(self) -> ModuleStats:
        return self.stats.get(self.model) or ModuleStats(_trainable_params(self.model))

    def get_total_flops(self, as_string: bool = False) -> int | str:
        n = self._root().flops
        return number_to_string(n) if as_string else n

    def get_total_macs(self, as_string: bool = False) -> int | str:
        n = self._root().macs
        return macs_to_string(n) if as_string else n

    def get_total_duration(self, as_string: bool = False) -> float | str:
        d = self._root().duration
        return duration_to_string(d) if as_string else d

    def get_total_params(self, as_string: bool = False) -> int | str:
        n = self._root().params
        return params_to_string(n) if as_string else n

    # -- printing (report.py) ------------------------------------------------------------------
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str:
        """Print (or write to `output_file`) the summary, the aggregated and the detailed
        profile; returns the text."""
        from .report import model_profile_text

        if not self.stats:
            return ""
        root = self._root()
        self.flops, self.macs, self.params = root.flops, root.macs, root.params
        text = model_profile_text(self, profile_step, module_depth, top_modules, detailed)
        if output_file:
            from pathlib import Path

            Path(output_file).parent.mkdir(parents=True, exist_ok=True)
            Path(output_file).write_text(text)
        else:
            print(text)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str:
        from .report import aggregated_text

        text = aggregated_text(self, module_depth, top_modules)
        print(text)
        return text

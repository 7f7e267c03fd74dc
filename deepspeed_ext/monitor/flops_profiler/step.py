"""The `flops_profiler` config section in training: profile one step, print it, move on.

The engine's phase timers call `phase(name)` around every forward, backward and optimizer
step; on the configured step (`profile_step`, counted in completed optimizer steps as
upstream does) and on global rank 0 only, the forward passes are counted by function and
module, the backward at the dispatcher, the step timed, and the profile printed at the end
of the step. Every micro-batch of that step is profiled; the counts are their sum.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepspeed_ext.utils.logging import logger

from .profiler import FlopsProfiler


class StepProfile:
    def __init__(
        self,
        section: Any,
        model: torch.nn.Module,
        engine: Any,
        steps_done: Callable[[], int],
        enabled_here: bool,
    ) -> None:
        self.section = section
        self.steps_done = steps_done
        self.profiler: FlopsProfiler | None = (
            FlopsProfiler(model, engine) if section.enabled and enabled_here else None
        )
        self._running = False
        self._done = False
        self.text = ""  # the printed profile, once made

    def _due(self) -> bool:
        return (
            self.profiler is not None
            and not self._done
            and self.steps_done() == int(self.section.profile_step)
        )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        p = self.profiler
        if p is None or not self._due():
            yield
            return
        if name == "forward":
            if self._running:
                p.resume_profile()
            else:
                p.start_profile()
                self._running = True
            try:
                with p.count_forward_dispatch():
                    yield
            finally:
                p.stop_profile()
        elif name == "backward" and self._running:
            with p.count_backward():
                yield
        elif name == "step" and self._running:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                p.step_duration = time.perf_counter() - t0
                self._finish(p)
        else:
            yield

    def _finish(self, p: FlopsProfiler) -> None:
        s = self.section
        self.text = p.print_model_profile(
            profile_step=int(s.profile_step),
            module_depth=int(s.module_depth),
            top_modules=int(s.top_modules),
            detailed=bool(s.detailed),
            output_file=s.output_file,
        )
        if s.output_file:
            logger.info(f"flops profile of step {s.profile_step} written to {s.output_file}")
        p.end_profile()
        self._running = False
        self._done = True

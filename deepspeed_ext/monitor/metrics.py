"""The one metrics line every steps_per_print steps, and the same values to the writers.

`step 100 | loss 2.3412 | lr 3.00e-04 | loss scale 65536 | samples/s 412.3 | tokens/s 26387 |
peak mem 1.21 GiB` on rank 0; throughput counts every rank's samples (global).
"""

from __future__ import annotations

import time
from typing import Any

from deepspeed_ext.utils.logging import logger

from .timers import PhaseTimers
from .writers import Writer


class StepMetrics:
    # the line's own values and the writers' columns; add_values() must not take these
    # names, nor a unit suffix of the timings (nor their upstream tags)
    RESERVED = frozenset(
        ["loss", "lr", "loss_scale", "grad_norm", "samples_per_s", "tokens_per_s"]
        + ["peak_mem_gib", "step", "samples", "train_loss"]
    )
    _UNITS = ("_ms", "_mb", "_x", "_n")

    @classmethod
    def name_clash(cls, name: Any) -> str | None:
        """Why add_values() cannot take `name`, or None."""
        if not isinstance(name, str) or not name:
            return f"the name {name!r} is not a non-empty string"
        if name in cls.RESERVED or name.endswith(cls._UNITS) or name.startswith("elapsed_time"):
            return (
                f"the name {name!r} is one of the metrics line's own ({sorted(cls.RESERVED)}, "
                f"or ends in one of {list(cls._UNITS)}, or starts with elapsed_time)"
            )
        return None

    def __init__(
        self,
        every: int | None,
        writers: list[Writer],
        peak_memory: Any,
        world_size: int,
        timers: PhaseTimers | None = None,
        throughput: bool = True,
        synchronize: Any = None,
        sources: list[Any] | None = None,
        rank_times: Any = None,
        loss_over_ranks: Any = None,
        monitored: bool = False,
    ) -> None:
        # (sum, count) of this rank's window losses -> the same summed over the data-parallel
        # ranks (a collective every rank reaches on print steps): the line's loss is the
        # mean over every rank's batches; None: this rank's own (already a mean: a pipeline's)
        self.loss_over_ranks = loss_over_ranks
        # timers.throughput: off drops samples/s and tokens/s; `synchronize` (the device's,
        # when timers.throughput.synchronized) makes the step's time include queued work
        self.throughput = throughput
        self.synchronize = synchronize
        # more "<name>_ms" timings: callables returning (and restarting) them, e.g. the
        # activation checkpoints' forward and recompute times with their profile on
        self.sources = sources or []
        # steps_per_print None (upstream's default): no periodic line; monitors still get
        # every step.
        self.print_line = every is not None
        self.every = max(1, int(every)) if every is not None else 1
        self.writers = writers
        self.rank_times = rank_times  # every rank's own window times (RankTimes), or None
        # whether a window is closed at all: the same answer on every rank (the monitors'
        # writers live on rank 0 only, but loss_over_ranks is a collective all must reach)
        self.reports = self.print_line or monitored or rank_times is not None or bool(writers)
        self._last_step = 0
        self.timers = timers
        self.peak_memory = peak_memory  # callable -> bytes
        self.world_size = world_size
        self._t0 = time.perf_counter()
        self._samples = 0
        self._tokens: int | None = 0
        self._losses: list[Any] = []  # detached loss tensors; read only when printing
        self._values: dict[str, list[float]] = {}  # add_values(), by name
        self.last: dict[str, float] = {}

    def mark(self) -> tuple[int, int | None]:
        """The counts so far, for rewind() (a batch that stopped before it sent anything)."""
        return self._samples, self._tokens

    def rewind(self, mark: tuple[int, int | None]) -> None:
        self._samples, self._tokens = mark

    def resume_at(self, step: int) -> None:
        """After a checkpoint load: the window ends at `step`, not at the steps run before
        (a rank's window of 1 step after a resume was written as 3)."""
        self._last_step = step
        self._t0 = time.perf_counter()
        self._samples, self._tokens, self._losses, self._values = 0, 0, [], {}

    def add_micro_batch(self, samples: int, tokens: int | None) -> None:
        self._samples += samples
        if tokens is None or self._tokens is None:
            self._tokens = None
        else:
            self._tokens += tokens

    def add_loss(self, loss: Any) -> None:
        self._losses.append(loss)

    def add_values(self, values: dict[str, float]) -> None:
        """More losses of the step by name (a pipeline's additional losses): averaged over
        the window like the loss, printed after it and written as they are named."""
        for name, v in values.items():
            self._values.setdefault(name, []).append(v)

    def on_step(
        self,
        step: int,
        samples: int,
        lr: float,
        loss_scale: float | None,
        grad_norm: float | None,
    ) -> None:
        if not self.reports:
            self._losses, self._values = [], {}  # nobody will read them: do not hold them
            return
        if step % self.every != 0:
            return
        if self.synchronize is not None:
            self.synchronize()
        dt = max(time.perf_counter() - self._t0, 1e-9)
        if self.rank_times is not None:
            self.rank_times.write(step, step - self._last_step, dt)
        self._last_step = step
        values: dict[str, float] = {}
        total, count = sum(float(x) for x in self._losses), float(len(self._losses))
        if self.loss_over_ranks is not None:
            total, count = self.loss_over_ranks(total, count)
        if count:
            values["loss"] = total / count
        named = {k: sum(vs) / len(vs) for k, vs in self._values.items()}
        values.update(named)
        values["lr"] = lr
        if loss_scale is not None:
            values["loss_scale"] = loss_scale
        if grad_norm is not None:
            values["grad_norm"] = grad_norm
        if self.throughput:
            values["samples_per_s"] = self._samples * self.world_size / dt
            if self._tokens:
                values["tokens_per_s"] = self._tokens * self.world_size / dt
        values["peak_mem_gib"] = self.peak_memory() / 2**30
        breakdown = self.timers.take_ms() if self.timers is not None else {}
        for source in self.sources:
            breakdown.update(source())
        memory = self.timers.memory.take_mb() if self.timers and self.timers.memory else {}
        values.update(breakdown)
        values.update(memory)
        self.last = values
        parts = [f"step {step}"]
        if "loss" in values:
            parts.append(f"loss {values['loss']:.4f}")
        parts += [f"{k} {v:.4f}" for k, v in named.items()]
        parts.append(f"lr {lr:.3e}")
        if loss_scale is not None:
            parts.append(f"loss scale {loss_scale:g}")
        if "samples_per_s" in values:
            parts.append(f"samples/s {values['samples_per_s']:.1f}")
        if "tokens_per_s" in values:
            parts.append(f"tokens/s {values['tokens_per_s']:.0f}")
        parts.append(f"peak mem {values['peak_mem_gib']:.2f} GiB")
        parts += [_column(k, v) for k, v in breakdown.items()]
        parts += [f"{k[:-3].replace('_', ' ')} {v:.0f} MB" for k, v in memory.items()]
        if self.print_line:
            logger.info(" | ".join(parts))
        for w in self.writers:
            w.write(step, samples, values)
        self._t0 = time.perf_counter()
        self._samples, self._tokens, self._losses, self._values = 0, 0, [], {}

    def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.rank_times is not None:
            self.rank_times.close()


def _column(key: str, value: float) -> str:
    """`forward_ms` -> `forward 12.3 ms`; `comm_mb` -> `comm 4.0 MB`; `compression_x` ->
    `compression 32.00x`; `slow_ranks_n` -> `slow ranks 1`."""
    name, _, unit = key.rpartition("_")
    label = name.replace("_", " ")
    if unit == "mb":
        return f"{label} {value:.3g} MB"
    if unit == "x":
        return f"{label} {value:.2f}x"
    if unit == "n":
        return f"{label} {value:.0f}"
    return f"{label} {value:.1f} ms"

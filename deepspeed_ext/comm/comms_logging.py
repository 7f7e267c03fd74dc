"""The comms logger (`comms_logger` config section, `deepspeed.comm.log_summary()`).

[Note: comms logger]
Every tensor collective passes through comm/checked.py; while the logger is on, each one of
the profiled ops is timed there (the device synchronized before and after, so the time is
the collective's own; an async op is timed from its issue to its wait()) and recorded under
its name and message size. Message size is the whole buffer the collective moves: the
reduced tensor, the gathered output, the scattered input. Bandwidths as nccl-tests defines
them: algbw = size / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for the
gathers, scatters and all_to_all, x 1 for broadcast, reduce and point-to-point, so busbw is
comparable with the link's speed whatever the op. A collective this runtime makes of other
calls (ZeRO's gloo reduce-scatter and all-gather, the hierarchical all-reduce and
reduce-scatter) is one row under the name of the collective it stands for (logical_call),
not rows of its parts.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed_ext.utils.logging import logger

_RING_2 = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}
_RING_1 = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "gather",
    "scatter",
}


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if op in _RING_2:
        return 2 * (n - 1) / n
    if op in _RING_1:
        return (n - 1) / n
    return 1.0


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


def message_bytes(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> int:
    """The whole buffer the collective moves (see [Note: comms logger])."""
    a = list(args)
    if op == "all_gather":  # (output list, input)
        return _bytes(a[0]) if a else 0
    if op in ("all_gather_into_tensor", "all_gather_single"):  # (output, input)
        return _bytes(a[0] if a else kwargs.get("output_tensor"))
    if op in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"):
        return _bytes(a[1] if len(a) > 1 else kwargs.get("input"))  # (output, input[s])
    if op == "all_to_all_single":
        return _bytes(a[1] if len(a) > 1 else kwargs.get("input"))
    if op in ("gather", "scatter"):
        return _bytes(a[0] if a else kwargs.get("tensor")) * n
    return _bytes(a[0] if a else kwargs.get("tensor"))


def size_string(b: int) -> str:
    if b <= 0:
        return "0 B"
    units = ("B", "KB", "MB", "GB", "TB")
    i = min(int(math.log(b, 1024)), len(units) - 1)
    return f"{round(b / 1024**i, 2):g} {units[i]}"


# one collective under torch's names old and new: prof_ops may name either
_SAME_OP = {
    "all_gather_into_tensor": "all_gather_single",
    "_all_gather_base": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
    "_reduce_scatter_base": "reduce_scatter_single",
}


@dataclass
class OpStats:
    latencies: list[float] = field(default_factory=list)  # seconds
    algbw: list[float] = field(default_factory=list)  # bytes/s
    busbw: list[float] = field(default_factory=list)


class CommsLogger:
    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        # record name -> message bytes -> stats
        self.comms_dict: dict[str, dict[int, OpStats]] = defaultdict(dict)
        self._window_s = 0.0  # time in logged collectives since take_window()
        self._window_bytes = 0
        self._muted = 0  # inside muted(): the parts of a collective recorded whole
        self._ops_for: list[str] = []  # the prof_ops that _ops was made from
        self._ops: set[str] = set()

    def configure(self, section: Any = None, **overrides: Any) -> None:
        """From a `comms_logger` config section and/or keyword overrides (upstream's
        deepspeed.comm.configure(enabled=..., prof_all=..., prof_ops=..., verbose=...,
        debug=...))."""
        values: dict[str, Any] = {}
        if section is not None:
            for key in ("enabled", "verbose", "prof_all", "prof_ops", "debug"):
                values[key] = getattr(section, key)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {"enabled", "verbose", "prof_all", "prof_ops", "debug"}
        if unknown:
            raise TypeError(
                f"comms logger: unknown setting(s) {sorted(unknown)}; use enabled, verbose, "
                "prof_all, prof_ops, debug"
            )
        for key, value in values.items():
            setattr(self, key, list(value) if key == "prof_ops" else bool(value))

    # upstream's switches
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in set(op_name_list)]

    def wants(self, op: str) -> bool:
        if not self.enabled or self._muted:
            return False
        if self.prof_all:
            return True
        if self._ops_for != self.prof_ops:  # prof_ops changed (configure, start/stop): re-read
            self._ops_for = list(self.prof_ops)
            self._ops = {_SAME_OP.get(o, o) for o in self.prof_ops}
        return _SAME_OP.get(op, op) in self._ops

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Collectives issued inside are not recorded: they are parts of one that a
        logical_call records whole (a hierarchical reduce-scatter's per-group steps)."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    def append(self, op: str, latency: float, msg_bytes: int, n: int) -> None:
        name = f"{op} | [Caller Func: {_caller()}]" if self.debug else op
        latency = max(latency, 1e-9)
        stats = self.comms_dict[name].setdefault(msg_bytes, OpStats())
        algbw = msg_bytes / latency
        stats.latencies.append(latency)
        stats.algbw.append(algbw)
        stats.busbw.append(algbw * bus_factor(op, n))
        self._window_s += latency
        self._window_bytes += msg_bytes
        if self.verbose:
            logger.info(
                f"comm op: {name} | time (ms): {latency * 1e3:.2f} | msg size: "
                f"{size_string(msg_bytes)} | algbw (Gbps): {algbw * 8 / 1e9:.2f} | busbw (Gbps): "
                f"{algbw * bus_factor(op, n) * 8 / 1e9:.2f}"
            )

    def take_window(self) -> dict[str, float]:
        """Milliseconds and megabytes of logged collectives since the last call (the
        metrics line's `comm` columns)."""
        out = {"comm_ms": self._window_s * 1e3, "comm_mb": self._window_bytes / 2**20}
        self._window_s, self._window_bytes = 0.0, 0
        return out if self.enabled else {}

    # upstream's readers
    def has_data(self) -> bool:
        return any(self.comms_dict.values())

    def reset_data(self) -> None:
        self.comms_dict.clear()
        self._window_s, self._window_bytes = 0.0, 0

    def get_operation_names(self) -> list[str]:
        return sorted(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(len(s.latencies) for sizes in self.comms_dict.values() for s in sizes.values())

    def total_bytes(self, op: str) -> int:
        """Bytes of every logged call of `op` since the last reset (ours)."""
        return sum(size * len(s.latencies) for size, s in self.comms_dict.get(op, {}).items())

    def get_raw_data(self) -> dict[str, dict[int, OpStats]]:
        return {k: dict(v) for k, v in self.comms_dict.items()}

    def summary_rows(self) -> dict[str, dict[int, dict[str, float]]]:
        out: dict[str, dict[int, dict[str, float]]] = {}
        for name in sorted(self.comms_dict):
            out[name] = {}
            for size, s in sorted(self.comms_dict[name].items()):
                total = sum(s.latencies)
                out[name][size] = {
                    "count": len(s.latencies),
                    "total_latency_ms": total * 1e3,
                    "avg_latency_ms": total * 1e3 / len(s.latencies),
                    "algbw_gbps": sum(s.algbw) / len(s.algbw) * 8 / 1e9,
                    "busbw_gbps": sum(s.busbw) / len(s.busbw) * 8 / 1e9,
                }
        return out


def _caller() -> str:
    """The first function outside deepspeed_ext.comm that called into it."""
    frame = sys._getframe(2)
    while frame is not None and "deepspeed_ext/comm/" in frame.f_code.co_filename.replace(
        "\\", "/"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_name if frame is not None else "?"


comms_logger = CommsLogger()


class TimedWork:
    """An async collective's handle: the op is recorded when it is waited on."""

    def __init__(self, work: Any, done: Any) -> None:
        self._work = work
        self._done = done

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._done is not None:
            self._done()
            self._done = None
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def logical_call(op: str, size: int, n: int, issue: Any) -> Any:
    """issue() starts one collective made of other torch.distributed calls (on gloo, ZeRO's
    bucket reduce-scatter as point-to-point exchanges, its all-gather as one broadcast per
    rank; [Note: in-place collectives on gloo]; a hierarchical sum's steps on node groups)
    and returns its pending handle: recorded as `op` of `size` bytes over `n` ranks, from
    the issue to its wait(). Its parts go through checked.parts, or are issued inside
    comms_logger.muted(), so the logger does not see them: a row is what the caller asked
    for and its busbw compares with the native collective's."""
    if not comms_logger.wants(op):
        return issue()
    from deepspeed_ext.accelerator import get_accelerator

    sync = get_accelerator().synchronize
    sync()
    t0 = time.perf_counter()
    work = issue()

    def done() -> None:
        sync()
        comms_logger.append(op, time.perf_counter() - t0, size, n)

    return TimedWork(work, done)


def timed_call(op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> Any:
    """Run one collective over `n` ranks, recording it ([Note: comms logger])."""
    from deepspeed_ext.accelerator import get_accelerator

    size = message_bytes(op, args, kwargs, n)
    sync = get_accelerator().synchronize
    sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if (
        out is not None
        and hasattr(out, "wait")
        and (kwargs.get("async_op") or op in ("isend", "irecv"))
    ):

        def done() -> None:
            sync()
            comms_logger.append(op, time.perf_counter() - t0, size, n)

        return TimedWork(out, done)
    sync()
    comms_logger.append(op, time.perf_counter() - t0, size, n)
    return out

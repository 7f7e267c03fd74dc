"""Shared helpers of the benchmarks under bench/ (see docs/benchmarks.md).

Machine description, the physical limit (memory copy bandwidth, measured in the calling
process), a wall-clock timer with median, a results writer and a plain-text table printer.
Scripts import it as `from common import ...` (their directory is on sys.path when run as
`python bench/<name>.py`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What a result was measured on: cpu model, cores, torch version and threads, device."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "python": platform.python_version(),
        "host": platform.node(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def busy_warning(threshold: float = 0.5) -> str | None:
    """A warning when the 1-minute load average shows other work on this machine: with
    every core busy, each parallel region waits for a descheduled thread, and the steps
    with many regions (torch's per-tensor loops) slow down far more than the others."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    if load <= threshold:
        return None
    return (
        f"warning: load average {load:.2f} on {os.cpu_count()} cores before the run; "
        "other processes distort the timings (ratios included). Rerun on a quiet machine."
    )


def progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    """A tqdm bar over `items` on an interactive terminal (tqdm installed); the items
    unchanged otherwise, so logs and CI output stay plain."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc=desc, unit="job", leave=False)


def time_s(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call (perf_counter). For a synchronous (CPU) call only."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


@dataclass
class Bandwidth:
    """A memory-bandwidth measurement: `moved_bytes` per repetition (read + write)."""

    kind: str
    moved_bytes: int
    times_s: list[float]

    @property
    def gbps(self) -> float:
        """Median bandwidth in GB/s (1e9 bytes)."""
        return self.moved_bytes / median(self.times_s) / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median_gbps": self.gbps}


def _timed_reps(fn: Callable[[], Any], reps: int, device: str) -> list[float]:
    """Seconds per call: CUDA events on a GPU, perf_counter on the CPU."""
    if device.startswith("cuda"):
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return times
    return [time_s(fn) for _ in range(reps)]


def copy_bandwidth(nbytes: int, reps: int, device: str = "cpu", warmup: int = 2) -> Bandwidth:
    """Copy one `nbytes` fp32 tensor into another with torch (its current thread count)
    `reps` times; counts read + write = 2 * nbytes per copy.

    On a CPU a plain store first reads the destination line (write-allocate), so the bus
    moves ~3 * nbytes while 2 * nbytes is counted: a kernel that writes back into lines it
    has just read (an optimizer step) can exceed this figure; see rmw_bandwidth().
    """
    n = max(1, nbytes // 4)
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(warmup):  # also faults in dst's pages
        dst.copy_(src)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return Bandwidth("copy", 2 * n * 4, _timed_reps(lambda: dst.copy_(src), reps, device))


def rmw_bandwidth(nbytes: int, reps: int, device: str = "cpu", warmup: int = 2) -> Bandwidth:
    """`a += b` on two `nbytes` fp32 tensors: reads a and b, writes a back (3 * nbytes
    counted, no write-allocate overhead), the access pattern of an in-place optimizer step."""
    n = max(1, nbytes // 4)
    a = torch.zeros(n, dtype=torch.float32, device=device)
    b = torch.zeros(n, dtype=torch.float32, device=device)
    for _ in range(warmup):
        a.add_(b)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return Bandwidth("rmw", 3 * n * 4, _timed_reps(lambda: a.add_(b), reps, device))


def upstream_python() -> Path:
    """The python of upstream DeepSpeed's venv (made by bench/peers/setup_upstream.sh)."""
    venv = os.environ.get("DS_UPSTREAM_VENV") or str(
        Path.home() / ".cache" / "deepspeed_ext" / "upstream-venv"
    )
    return Path(venv) / "bin" / "python"


def result_path(name: str, smoke: bool) -> Path:
    # DS_BENCH_RESULTS redirects output (the test suite's smoke runs write to a temp dir).
    base = Path(os.environ["DS_BENCH_RESULTS"]) if os.environ.get("DS_BENCH_RESULTS") else RESULTS
    return base / (f"{name}_smoke.json" if smoke else f"{name}.json")


def write_result(
    name: str, payload: dict[str, Any], smoke: bool = False, path: Path | None = None
) -> Path:
    """Write bench/results/<name>.json (<name>_smoke.json in smoke mode), or `path` when
    given; returns the path written."""
    path = path or result_path(name, smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Plain-text table: first column left-aligned, the others right-aligned. Floats are
    printed as given, so format them before."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))

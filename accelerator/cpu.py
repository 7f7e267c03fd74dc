"""CPU accelerator: gloo, host memory (the process RSS), streams and events as no-ops."""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

import torch

from . import strict
from .abstract import Accelerator


class _NoopStream:
    """Stands in for a device stream on a device that has none."""

    def synchronize(self) -> None:
        strict.synced_through()

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        ev = event or _NoopEvent()
        ev.record()
        return ev


class _NoopEvent:
    def __init__(self, **kwargs: Any) -> None:
        self.enable_timing = bool(kwargs.get("enable_timing", False))
        self.epoch = 0  # device-strict mode: the async copies this event follows

    def record(self, stream: Any = None) -> None:
        self.epoch = strict.record_epoch()

    def synchronize(self) -> None:
        strict.synced_through(self.epoch)

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        strict.synced_through(self.epoch)
        return True


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class CPUAccelerator(Accelerator):
    _name = "cpu"
    _communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        # Ranks on a CPU host are processes; the launcher decides how many (--num_gpus).
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def set_device(self, device_index: int) -> None:
        return None

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # torch has one cpu device; rank indices do not apply

    def is_synchronized_device(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # storage and kernels support it; matmuls run slower than bf16 on CPU

    # Memory: the process resident set, since CPU tensors live there.
    def memory_allocated(self, device_index: int | None = None) -> int:
        return _proc_status_kb("VmRSS") * 1024

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        hwm = _proc_status_kb("VmHWM")
        return (hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def total_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # nothing to pin for: no device copies

    def synchronize(self, device_index: int | None = None) -> None:
        strict.synced_through()

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return _NoopStream()

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802
        return _NoopEvent(**kwargs)

    def current_stream(self, device_index: int | None = None) -> Any:
        return _NoopStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

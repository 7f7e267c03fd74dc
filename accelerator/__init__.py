"""get_accelerator(): cuda when a GPU is usable, else cpu; DS_ACCELERATOR=cpu|cuda forces one."""

from __future__ import annotations

import os

from .abstract import Accelerator
from .cpu import CPUAccelerator

_accelerator: Accelerator | None = None
KNOWN = ("cpu", "cuda")


def _make(name: str) -> Accelerator:
    if name == "cpu":
        return CPUAccelerator()
    if name == "cuda":
        from .cuda import CUDAAccelerator

        return CUDAAccelerator()
    raise ValueError(f"DS_ACCELERATOR={name!r} is not one of {', '.join(KNOWN)}")


def _detect() -> Accelerator:
    forced = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if forced:
        acc = _make(forced)
        if not acc.is_available():
            raise RuntimeError(
                f"DS_ACCELERATOR={forced} but no usable {forced} device was found; "
                "unset DS_ACCELERATOR to pick one automatically"
            )
        return acc
    from .cuda import CUDAAccelerator

    cuda = CUDAAccelerator()
    return cuda if cuda.is_available() else CPUAccelerator()


def get_accelerator() -> Accelerator:
    global _accelerator
    if _accelerator is None:
        _accelerator = _detect()
    return _accelerator


def set_accelerator(accel: Accelerator | None) -> None:
    """Install an accelerator object (None re-detects on next use)."""
    global _accelerator
    _accelerator = accel


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in KNOWN


__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]

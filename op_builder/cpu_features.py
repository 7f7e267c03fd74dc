"""Which SIMD level the CPU kernels are built for on this machine.

The level is chosen once per machine from the CPU flags, and can be forced with
DS_SIMD=avx512|avx2|scalar (e.g. to test the scalar path, or to build for an older fleet).
"""

from __future__ import annotations

import functools
import os
import platform

LEVELS = ("avx512", "avx2", "scalar")

# The instruction sets each level's code uses (simd.h): f16c for fp16 conversion, fma.
_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}
_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def best_level() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"
    flags = cpu_flags()
    for level in LEVELS:
        if _NEEDS[level] <= flags:
            return level
    return "scalar"


def simd_level() -> str:
    forced = os.environ.get("DS_SIMD", "").strip().lower()
    if forced:
        if forced not in LEVELS:
            raise ValueError(f"DS_SIMD={forced!r} is not one of {', '.join(LEVELS)}")
        if not _NEEDS[forced] <= cpu_flags() and forced != "scalar":
            raise ValueError(
                f"DS_SIMD={forced} needs CPU flags {sorted(_NEEDS[forced] - cpu_flags())} "
                "that this machine lacks; unset DS_SIMD to pick the best level"
            )
        return forced
    return best_level()


def simd_flags(level: str) -> list[str]:
    return list(_FLAGS[level])


def simd_width(level: str) -> int:
    """fp32 lanes per vector."""
    return {"avx512": 16, "avx2": 8, "scalar": 1}[level]

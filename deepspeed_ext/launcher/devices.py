"""Which GPUs this node offers, decided without importing torch (the launcher must start fast
and must not initialise CUDA in the parent of every rank)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

_PROC_GPUS = "/proc/driver/nvidia/gpus"


def physical_gpu_count() -> int:
    """NVIDIA GPUs on this machine (CUDA_VISIBLE_DEVICES does not apply here)."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=15, check=True
            ).stdout
            # one `GPU i: ...` line per GPU; MIG instances are indented lines under it
            return sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            pass  # a broken driver install: fall back to the kernel module's view
    try:
        return len(os.listdir(_PROC_GPUS))
    except OSError:
        return 0


def _visible(cvd: str, count: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries CUDA would honour: it stops at the first bad index."""
    out: list[str] = []
    for entry in (e.strip() for e in cvd.split(",")):
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            if not 0 <= int(entry) < count:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break
        out.append(entry)
    return out


def local_gpus(environ: Mapping[str, str] | None = None, count: int | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries ranks may use here; [] means the ranks run on CPU.

    DS_ACCELERATOR=cpu forces CPU ranks even where GPUs exist.
    """
    env = os.environ if environ is None else environ
    if env.get("DS_ACCELERATOR", "").lower() == "cpu":
        return []
    n = physical_gpu_count() if count is None else count
    if n == 0:
        return []
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [str(i) for i in range(n)]
    return _visible(cvd, n)

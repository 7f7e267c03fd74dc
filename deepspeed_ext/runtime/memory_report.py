"""`deepspeed.runtime.utils.see_memory_usage`: one line of device and host memory."""

from __future__ import annotations

import os

from deepspeed_ext.utils.logging import logger


def _host_used_gib() -> tuple[float, float]:
    """(used GiB, percent used) of host memory, from /proc/meminfo (no psutil needed)."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        total, avail = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return float("nan"), float("nan")
    return (total - avail) / 2**30, 100.0 * (total - avail) / total


def see_memory_usage(message: str, force: bool = False) -> None:
    """Logs the message with the accelerator's allocated and peak memory and the host's use,
    on rank 0, when force is true (upstream's rule: otherwise nothing, so calls can stay in
    code); then resets the peak."""
    if not force or int(os.environ.get("RANK", "0")) != 0:
        return
    from deepspeed_ext.accelerator import get_accelerator

    acc = get_accelerator()
    gib = 2**30
    used, percent = _host_used_gib()
    logger.info(
        f"{message} | MA {acc.memory_allocated() / gib:.2f} GB | "
        f"Max_MA {acc.max_memory_allocated() / gib:.2f} GB | "
        f"CPU Virtual Memory: used = {used:.2f} GB, percent = {percent:.1f}%"
    )
    acc.reset_peak_memory_stats()

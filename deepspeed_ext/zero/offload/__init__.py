"""Offload tiers of ZeRO: nvme (ZeRO-Infinity's swap files through the async_io op)."""

from .nvme import NVMeSwapper, check_nvme_path

__all__ = ["NVMeSwapper", "check_nvme_path"]

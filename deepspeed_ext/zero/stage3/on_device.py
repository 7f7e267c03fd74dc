"""`deepspeed.zero.OnDevice`: build a module's parameters on a given device (e.g. "meta",
to get its structure without memory) and in a given dtype."""

from __future__ import annotations

from typing import Any

import torch


class OnDevice:
    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype}): a floating-point dtype, or None")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._device_ctx: Any = None
        self._old_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._device_ctx = torch.device(self.device)
            self._device_ctx.__enter__()
            if self.dtype is not None:
                self._old_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None
        self._device_ctx.__exit__(*exc)
        self._device_ctx = None

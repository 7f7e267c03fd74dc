"""`torch_autocast`: run forward under torch.autocast instead of casting the model."""

from __future__ import annotations

from ..types import Bool, FloatDtypeName, Section, Str


class TorchAutocastConfig(Section):
    enabled: Bool = False
    dtype: FloatDtypeName | None = None
    # Module classes (dotted import paths) that may run in the lower precision.
    lower_precision_safe_modules: tuple[Str, ...] | None = None

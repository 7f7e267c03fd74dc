"""`data_types`: dtypes of gradient accumulation, parameters and buffers."""

from __future__ import annotations

from ..types import Auto, FloatDtypeName, Section, Str


class DataTypesConfig(Section):
    # None: follow the training precision (fp32 accumulation under fp16/bf16).
    grad_accum_dtype: FloatDtypeName | None = None
    param_dtype: FloatDtypeName | None = None
    # None keeps buffers in the dtype they were loaded with.
    buffer_dtype: FloatDtypeName | None = None
    # "auto" (a real upstream value, not a placeholder) or a list of module-name patterns.
    keep_in_fp32_modules: Auto | tuple[Str, ...] = "auto"

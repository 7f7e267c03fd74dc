"""`deepspeed.runtime.zero.stage3`: upstream's import path of the ZeRO 3 memory estimators
([Note: model-state memory] in deepspeed_ext/zero/estimate.py)."""

from deepspeed_ext.zero.estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]

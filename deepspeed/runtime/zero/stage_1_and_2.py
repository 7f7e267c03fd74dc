"""`deepspeed.runtime.zero.stage_1_and_2`: upstream's import path of the ZeRO 1/2 memory
estimators ([Note: model-state memory] in deepspeed_ext/zero/estimate.py)."""

from deepspeed_ext.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

# Upstream's stage_1_and_2.model_to_params is the total count alone (an int), while
# stage3's of the same name returns (total, largest layer).
from deepspeed_ext.zero.estimate import model_param_count as model_to_params

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]

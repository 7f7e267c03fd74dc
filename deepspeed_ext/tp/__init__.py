"""Tensor slicing (AutoTP training): plans, sliced layers, and the model transform
deepspeed.initialize applies before the gradient strategy is built (layer 4: comm, config)."""

from .apply import Sliced, replicated_params, slice_model
from .export import full_state_dict, slice_table, spec_from_table
from .layers import LinearAllreduce, LinearLayer
from .plan import PRESETS, LayerRule, PlanError
from .slicing import SliceError, TensorSlice

__all__ = [
    "PRESETS",
    "LayerRule",
    "LinearAllreduce",
    "LinearLayer",
    "PlanError",
    "SliceError",
    "Sliced",
    "TensorSlice",
    "full_state_dict",
    "replicated_params",
    "slice_model",
    "slice_table",
    "spec_from_table",
]

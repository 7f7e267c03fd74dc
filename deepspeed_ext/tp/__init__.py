"""Tensor slicing (AutoTP training): plans, sliced layers, and the model transform
deepspeed.initialize applies before the gradient strategy is built (layer 4: comm, config)."""

from .apply import Sliced, replicated_params, slice_model
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
    "replicated_params",
    "slice_model",
]

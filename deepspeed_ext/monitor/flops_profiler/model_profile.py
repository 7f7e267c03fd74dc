"""get_model_profile: profile one forward (or generate) call of a model outside training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .profiler import FlopsProfiler
from .units import macs_to_string, number_to_string, params_to_string


def _inputs(
    model: torch.nn.Module, input_shape: Sequence[int] | None, args: Any, kwargs: Any
) -> tuple[list[Any], dict[str, Any]]:
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError(
                "get_model_profile: give either input_shape or args/kwargs, not both "
                f"(input_shape={tuple(input_shape)})"
            )
        if not isinstance(input_shape, (tuple, list)) or not input_shape:
            raise ValueError(
                f"get_model_profile: input_shape={input_shape!r} must be a non-empty tuple of "
                "ints, e.g. (batch, 3, 224, 224)"
            )
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.randn(tuple(input_shape), dtype=dtype, device=device)]
    elif not args and not kwargs:
        raise ValueError(
            "get_model_profile: give input_shape, or the model's inputs as args / kwargs"
        )
    return args, kwargs


def get_model_profile(
    model: torch.nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Any = None,
    kwargs: Any = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """(flops, macs, params) of one call, after `warm_up` unprofiled calls. Each profile
    starts from zero, so calling this twice gives the same counts."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model)}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode={mode!r}; use 'forward' or 'generate'")
    call_args, call_kwargs = _inputs(model, input_shape, args, kwargs)
    fn: Any = model if mode == "forward" else model.generate
    for _ in range(max(0, warm_up)):
        fn(*call_args, **call_kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        fn(*call_args, **call_kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = (
        int(prof.get_total_flops()),
        int(prof.get_total_macs()),
        int(prof.get_total_params()),
    )
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params

"""`deepspeed.zero.unwrap_model_for_generation`: the plain module with every parameter whole
for the duration (generation calls submodules in orders the stage-3 hooks did not record)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .gathered import GatheredParameters
from .param import is_zero_param


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[torch.nn.Module]:
    """model: an engine or a module. Below stage 3 it only unwraps. Every rank must enter it
    (the gather is collective)."""
    module = getattr(model, "module", model)
    params = [p for p in module.parameters() if is_zero_param(p)]
    if not params:
        yield module
        return
    with GatheredParameters(params):
        yield module

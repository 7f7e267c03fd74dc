"""The `torch_autocast` section: a model kept in fp32 whose forward runs under torch.autocast.

[Note: torch_autocast]
Upstream's alternative to casting the model (fp16 / bf16 sections): the weights, the
gradients and the optimizer stay fp32, and the engine's forward (a pipeline stage's too)
runs inside `torch.autocast(device, dtype)`, which picks each op's precision. The dtype
unset is the device's autocast default (bf16 on the host, fp16 on CUDA), as torch.autocast
takes it. With fp16 the loss is scaled as torch's GradScaler scales it by default (2**16 at
first, halved and the step skipped on overflow, doubled after 2000 clean steps; below 1
too), so an
overflowing step is skipped as under the fp16 section. Gradients are reduced in
communication_data_type (fp32 unless set): upstream reduces those of its
`lower_precision_safe_modules` (Linear and Conv by default) in the autocast dtype, so that
key, which only picks those, is refused when given.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .dtypes import config_dtype
from .loss_scaler import DynamicLossScaler


def autocast_dtype(section: Any, device_type: str) -> torch.dtype | None:
    """The dtype the forward runs in under torch_autocast; None: the section is off."""
    name = section.dtype
    if not section.enabled:
        return None
    return torch.get_autocast_dtype(device_type) if name is None else config_dtype(name)


def forward_context(dtype: torch.dtype | None, device_type: str) -> Any:
    """torch.autocast for the forward (nothing when torch_autocast is off: a caller's own
    autocast stays as it is)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def loss_scaler() -> DynamicLossScaler:
    """torch.amp.GradScaler's defaults, in the engine's loss scaler (no hysteresis, and no
    floor but float32's smallest normal, where GradScaler has none)."""
    return DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=2000,
        hysteresis=1,
        min_scale=float(torch.finfo(torch.float32).tiny),
        advice='Set torch_autocast.dtype "bf16".',
    )


def check(config: Any, dtype: torch.dtype | None) -> None:
    """What scales the loss clashes with, once the dtype is known (the device decides an
    unset one)."""
    if dtype != torch.float16:
        return
    what = "torch_autocast in fp16 (its loss scaling skips a step whose gradients overflow)"
    offload = config.zero_optimization.offload_optimizer
    if offload is not None and offload.step_in_backward:
        raise ValueError(
            f"zero_optimization.offload_optimizer.step_in_backward does not work with {what}: "
            'set torch_autocast.dtype "bf16", or remove step_in_backward'
        )
    if config.gradient_compression is not None:
        raise ValueError(
            f"gradient_compression does not work with {what}: the exchange folds an "
            "overflowing step's gradients into the error buffers before the step is skipped; "
            'set torch_autocast.dtype "bf16", or remove gradient_compression'
        )

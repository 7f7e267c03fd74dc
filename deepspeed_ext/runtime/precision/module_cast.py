"""The model's dtypes under fp16 / bf16 (upstream 0.19's rules).

[Note: module cast]
fp16 or bf16 casts the model's floating parameters (fp64, fp32, fp16, bf16) to that dtype;
its buffers keep the dtype they have (a rotary embedding's `inv_freq` stays fp32), unless
`data_types.buffer_dtype` names one. A model built under zero.Init made its tensors through
torch's constructors (empty, zeros, ones, full, tensor, arange, eye, randn), which the Init
turns to the training dtype as upstream's does (stage3/init.py); the rest (a `.float()` of
them, a linspace) keep theirs. Either way the buffers `data_types.keep_in_fp32_modules`
selects stay, or become, fp32 (zero/keep_fp32.py): "auto" takes the model's own Hugging
Face lists (`_keep_in_fp32_modules_strict`, and under fp16 `_keep_in_fp32_modules` too), a
list gives patterns (regular expressions in which `*` is any characters, matched anywhere in
the buffer's full name), `[]` none. A buffer two modules share is kept if either name
matches. The lists keep buffers only (as upstream's): parameters they name still follow the
training dtype, and an explicit pattern that names parameters is said once. Beyond
upstream: the running statistics of batch and instance norms always take the training dtype
with their module's parameters, whatever buffer_dtype or the lists say (torch's norms take
one dtype for both; upstream's rule leaves them fp32 beside 16-bit weights, and the forward
fails).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.keep_fp32 import keep_pattern, kept_buffers
from deepspeed_ext.zero.stage3.param import is_zero_param

CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _buffers(module: torch.nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, whether a norm's running statistic) of each floating buffer."""
    out = []
    for owner in module.modules():
        stats = isinstance(owner, torch.nn.modules.batchnorm._NormBase)
        for buf in owner.buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                out.append((buf, stats))
    return out


@torch.no_grad()
def cast_module(
    module: torch.nn.Module, dtype: torch.dtype, buffer_dtype: torch.dtype | None, keep: Any
) -> None:
    """[Note: module cast] for a model trained in `dtype` (fp16 or bf16)."""
    for p in module.parameters():
        if not is_zero_param(p) and p.dtype in CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)  # (zero.Init made its own in the training dtype)
    pattern = keep_pattern(module, keep, dtype)
    if pattern is not None and keep != "auto":
        named = [n for n, _ in module.named_parameters() if pattern.search(n)]
        if named:
            logger.warning(
                f"data_types.keep_in_fp32_modules keeps buffers in fp32, not parameters: "
                f"{named[:3]}{' ...' if len(named) > 3 else ''} train in {dtype} (their fp32 "
                "masters hold the precise values); fp16_override_modules runs a module's "
                "forward in fp32"
            )
    kept = kept_buffers(module, pattern)
    for buf, stats in _buffers(module):
        if stats:  # a norm's running statistics: its weights' dtype
            want: torch.dtype | None = dtype
        elif id(buf) in kept:  # by identity: a shared buffer kept under any of its names
            want = torch.float32
        else:
            want = buffer_dtype
        if want is not None and buf.dtype in CASTABLE and buf.dtype != want:
            buf.data = buf.data.to(want)  # in place: a buffer shared by modules stays shared

"""The model's dtypes under fp16 / bf16 (upstream 0.19's rules).

[Note: module cast]
fp16 or bf16 casts the model's floating parameters (fp64, fp32, fp16, bf16) to that dtype;
its buffers keep the dtype they have (a rotary embedding's `inv_freq` stays fp32), unless
`data_types.buffer_dtype` names one. A model built under zero.Init had its parameters made in
the training dtype, and its buffers too (as upstream's Init turns every floating tensor made
in `__init__`); they are left so. Either way the buffers that `data_types.keep_in_fp32_modules`
selects stay, or become, fp32: "auto" takes the model's own Hugging Face lists
(`_keep_in_fp32_modules_strict`, and under fp16 `_keep_in_fp32_modules` too), a list gives
name patterns (`*` any characters, matched anywhere in the buffer's full name), `[]` none.
Parameters named by those lists still follow the training dtype, as upstream's.
The lists keep buffers only (as upstream's): a pattern that also names parameters is said
once. Beyond upstream: the running statistics of batch and instance norms always take the
training dtype with their module's parameters, whatever buffer_dtype or the lists say
(torch's norms take one dtype for both; upstream's rule leaves them fp32 beside 16-bit
weights, and the forward fails).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.stage3.param import is_zero_param

CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_pattern(module: torch.nn.Module, setting: Any, dtype: torch.dtype) -> re.Pattern | None:
    """The buffer names to keep in fp32 (None: none); nothing under fp32 training."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns: set[str] = set()
    if setting is None or setting == "auto":
        for path, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                glob = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(path)}\..*{glob}" if path else glob)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(full name, tensor, whether a norm's running statistic) of each floating buffer."""
    out = []
    for path, owner in module.named_modules():
        stats = isinstance(owner, torch.nn.modules.batchnorm._NormBase)
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                out.append((f"{path}.{name}" if path else name, buf, stats))
    return out


@torch.no_grad()
def cast_module(
    module: torch.nn.Module, dtype: torch.dtype, buffer_dtype: torch.dtype | None, keep: Any
) -> None:
    """[Note: module cast] for a model trained in `dtype` (fp16 or bf16)."""
    zero_init = False
    for p in module.parameters():
        if is_zero_param(p):  # made in the training dtype by zero.Init
            zero_init = True
        elif p.dtype in CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)
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
    for full, buf, stats in _buffers(module):
        if stats:  # a norm's running statistics: its weights' dtype
            want: torch.dtype | None = dtype
        elif pattern is not None and pattern.search(full):
            want = torch.float32
        elif buffer_dtype is not None:
            want = buffer_dtype
        else:
            want = dtype if zero_init else None
        if want is not None and buf.dtype in CASTABLE and buf.dtype != want:
            buf.data = buf.data.to(want)  # in place: a buffer shared by modules stays shared

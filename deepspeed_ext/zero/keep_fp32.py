"""Which buffers stay fp32 in a 16-bit model: data_types.keep_in_fp32_modules ([Note: module
cast] in runtime/precision/module_cast.py), used where the model is cast and by zero.Init
as each module is built (so a checkpoint loaded into the model meanwhile keeps fp32 there)."""

from __future__ import annotations

import re
from typing import Any

import torch

KEY = "data_types.keep_in_fp32_modules"


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
    if not patterns:
        return None
    try:
        return re.compile("|".join(sorted(patterns)))
    except re.error as e:
        raise ValueError(
            f"{KEY}: {sorted(patterns)} is not a valid pattern ({e}); patterns are regular "
            "expressions in which * stands for any characters"
        ) from e


def kept_buffers(module: torch.nn.Module, pattern: re.Pattern | None) -> dict[int, torch.Tensor]:
    """The floating buffers whose full names match, by id (a buffer shared by two modules
    is kept if either name matches)."""
    out: dict[int, torch.Tensor] = {}
    if pattern is None:
        return out
    for path, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            full = f"{path}.{name}" if path else name
            if buf is not None and buf.is_floating_point() and pattern.search(full):
                out[id(buf)] = buf
    return out


@torch.no_grad()
def keep_fp32(module: torch.nn.Module, setting: Any, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Turn the buffers to keep back to fp32 (in place); returns them by id."""
    kept = kept_buffers(module, keep_pattern(module, setting, dtype))
    for buf in kept.values():
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()
    return kept

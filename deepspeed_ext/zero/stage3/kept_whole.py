"""zero_optimization.zero_allowed_param_types / zero_force_param_types: which parameters
ZeRO-3 keeps whole by the class of the module that owns them (see the config section)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kept_whole(
    module: torch.nn.Module, allowed: Sequence[str] | None, forced: Sequence[str]
) -> set[int]:
    """ids of the parameters to keep whole."""
    if allowed is None and not forced:
        return set()
    out: set[int] = set()
    for m in module.modules():
        cls = type(m)
        names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
        whole = bool(names & set(forced)) or (allowed is not None and not names & set(allowed))
        if whole:
            out |= {id(p) for p in m.parameters(recurse=False)}
    return out

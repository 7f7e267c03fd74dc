"""Which ops setup.py prebuilds into the wheel: DS_BUILD_OPS=1 for all compatible ops,
DS_BUILD_<OP>=1 / =0 to include or exclude one."""

from __future__ import annotations

import os
from typing import Any

from .all_ops import ALL_OPS
from .errors import OpBuildError


def _flag(name: str) -> bool | None:
    v = os.environ.get(name)
    return None if v is None or v == "" else v not in ("0", "false", "False")


def selected_ops() -> list[str]:
    everything = _flag("DS_BUILD_OPS")
    out = []
    for name, cls in ALL_OPS.items():
        own = _flag(cls.build_var())
        if own is True or (own is None and everything):
            out.append(name)
    return out


def prebuild_extensions() -> tuple[list[Any], dict[str, Any]]:
    names = selected_ops()
    if not names:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        raise OpBuildError(
            "DS_BUILD_OPS / DS_BUILD_<OP> needs torch at install time: install torch first, "
            "then `pip install --no-build-isolation .`"
        ) from None
    exts = []
    explicit = {n for n in names if _flag(ALL_OPS[n].build_var())}
    for name in names:
        builder = ALL_OPS[name]()
        compat = builder.is_compatible()
        if not compat:
            if name in explicit:
                raise OpBuildError(f"{builder.build_var()}=1 but op '{name}': {compat.reason}")
            print(f"[deepspeed_ext] not prebuilding '{name}': {compat.reason}")
            continue
        exts.append(builder.builder())
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=True)}

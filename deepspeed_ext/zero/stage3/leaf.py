"""Leaf modules: gathered as a whole, their children get no hooks of their own (upstream's
`set_z3_leaf_modules`). For modules whose children run in a data-dependent order or not at
all (mixture-of-experts routers), where per-child gathers would differ between ranks."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.utils.logging import logger


def is_leaf_module(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_z3_leaf", False))


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[Any]:
    """Mark every submodule of the given classes (classes or class names) as a leaf; returns
    the marked modules. An empty match is an error naming the classes."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[Any]:
    return _mark(model, leaf_module_classes, False)


def z3_leaf_module(module: torch.nn.Module) -> bool:
    return is_leaf_module(module)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_leaf_module(m)]


def _mark(model: torch.nn.Module, classes: list[Any], flag: bool) -> list[Any]:
    wanted = {c if isinstance(c, str) else c.__name__ for c in classes}
    hits = [m for m in model.modules() if type(m).__name__ in wanted]
    if not hits:
        raise ValueError(
            f"set_z3_leaf_modules: no submodule of {type(model).__name__} is of class "
            f"{sorted(wanted)}; pass the classes (or class names) the model actually uses"
        )
    for m in hits:
        setattr(m, "_z3_leaf", flag)  # noqa: B010 - a plain attribute on any module
    return hits


def mark_config_leaves(model: torch.nn.Module, leaf_cfg: Any) -> list[torch.nn.Module]:
    """zero_optimization.leaf_module: mark modules whose class (name or dotted path) is in
    `classes`, whose name is in `names`, or whose name ends with one of `name_suffixes`.
    The default classes are upstream's MoE blocks, absent from most models, so no match is
    not an error; a user-given entry that matches nothing is said once."""
    classes, names, suffixes = set(leaf_cfg.classes), set(leaf_cfg.names), leaf_cfg.name_suffixes
    hit: list[torch.nn.Module] = []
    used: set[str] = set()
    for name, m in model.named_modules():
        cls = type(m)
        keys = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"} & classes
        if name in names:
            keys.add(name)
        keys |= {s for s in suffixes if name and name.endswith(s)}
        if keys:
            setattr(m, "_z3_leaf", True)  # noqa: B010 - a plain attribute on any module
            hit.append(m)
            used |= keys
    given = {**dict.fromkeys(leaf_cfg.names, "names"), **dict.fromkeys(suffixes, "name_suffixes")}
    if "classes" in leaf_cfg.model_fields_set:
        given.update(dict.fromkeys(leaf_cfg.classes, "classes"))
    for entry, key in given.items():
        if entry not in used:
            logger.warning(f"zero_optimization.leaf_module.{key}: {entry!r} matches no module")
    return hit

"""Upstream's MoE parameter helpers: which params are experts', and optimizer groups that
keep them apart (upstream's ZeRO partitions each such group over its own ranks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether the model has an MoE layer, the first one's num_experts)."""
    from .layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_shared_and_expert_params(
    params: Iterable[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    shared: list[torch.nn.Parameter] = []
    expert: list[torch.nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[torch.nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The .grad of each param that has one, as (shared, expert), in the param's dtype."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """Each group's expert params move to new groups (one per expert group name, chunked to
    max_group_size elements) with the group's options, `name` set to the expert group's and
    `moe` True; the dense params stay. The given list is changed in place and returned, as
    upstream's is."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = param_groups if isinstance(param_groups, list) else list(param_groups)
    else:
        raise ValueError(
            f"param_groups must be a dict or a list of dicts, not {type(param_groups).__name__}"
        )
    added: list[dict[str, Any]] = []
    for g in groups:
        by_name: dict[str, list[torch.nn.Parameter]] = {}
        dense = []
        for p in g["params"]:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", None) or "experts", []).append(p)
            else:
                dense.append(p)
        g["params"] = dense
        for name, params in by_name.items():
            for chunk in _chunks(params, max_group_size):
                added.append({**g, "name": name, "moe": True, "params": chunk})
    groups.extend(added)
    return groups


def _chunks(params: list[torch.nn.Parameter], limit: int | float | None) -> list[list[Any]]:
    if limit is None:
        return [params]
    out: list[list[Any]] = []
    cur: list[Any] = []
    size = 0
    for p in params:
        if cur and size + p.numel() > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    return out + [cur] if cur else out


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Optimizer groups from a list of params or of groups, expert params kept apart."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("model_parameters must be a non-empty list of tensors or of dicts")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                f"model_parameters must hold tensors or param-group dicts, not {type(p).__name__}"
            )
    if any(isinstance(g, dict) and is_moe_param_group(g) for g in model_parameters):
        return model_parameters  # already split (upstream's rule: nothing to do)
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)

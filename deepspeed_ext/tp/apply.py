"""AutoTP training: slice an unmodified model's layers over the tensor-parallel group.

Called by deepspeed.initialize before the gradient strategy exists. The model is first made
the same on every tensor-parallel rank (a broadcast from the group's first rank), so the
slices are of one model however each rank initialised it; then every linear layer a rule
matches ([Note: slicing rules]) is replaced by its sliced form ([Note: tensor slices]), and
attention modules that split a fused projection by a stored width learn the local width.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed_ext.comm import AxisGroup, group_broadcast_many

from . import plan
from .layers import (
    LinearAllreduce,
    LinearLayer,
    is_conv1d,
    is_linear_like,
    out_dim,
    vocab_parallel,
)
from .slicing import TensorSlice

logger = logging.getLogger("deepspeed_ext")

_ATTENTION = re.compile(r"(^|\.)(attn|attention|self_attn|self_attention)(\.|$)")
# per-module widths and head counts that a sliced attention module must see as local
_LOCAL_ATTRS = ("split_size", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads")
_CONFIG_HEADS = ("n_head", "num_attention_heads", "num_key_value_heads")  # ... in a config


@dataclass
class Sliced:
    layers: list[str] = field(default_factory=list)  # module names, in model order
    sources: set[str] = field(default_factory=set)
    kept_whole: list[str] = field(default_factory=list)  # matched, left whole (tied weights)


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int


def heads_of(model: Any) -> Heads | None:
    """Attention geometry from a Hugging Face style config, when the model has one."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not isinstance(n, int) or not isinstance(hidden, int) or n <= 0:
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or n
    head_dim = getattr(cfg, "head_dim", None) or hidden // n
    return Heads(n, int(kv), int(head_dim))


@torch.no_grad()
def _same_everywhere(model: torch.nn.Module, axis: AxisGroup) -> None:
    group_broadcast_many([t.data for t in [*model.parameters(), *model.buffers()]], axis)


def _dim(module: torch.nn.Module, rule: plan.LayerRule) -> int:
    """The weight dim to cut: upstream's partition_dim is in Linear terms ([out, in])."""
    if rule.partition_dim is not None:
        dim = rule.partition_dim
    else:
        dim = 1 if rule.kind == "row" else 0
    return 1 - dim if is_conv1d(module) else dim


def _qkv_parts(name: str, total: int, heads: Heads | None) -> tuple[int, ...] | int:
    if heads is None:
        return 3
    q, kv = heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim
    if q + 2 * kv == total:
        return (q, kv, kv)
    raise plan.PlanError(
        f"{name}: a fused q/k/v weight of {total} output features does not match the model "
        f"config ({heads.heads} heads, {heads.kv_heads} key/value heads of {heads.head_dim}); "
        "give its sub-parameter sizes with a partition_config spec's shape"
    )


def _slice_layer(
    name: str, module: torch.nn.Module, rule: plan.LayerRule, axis: AxisGroup, heads: Heads | None
) -> torch.nn.Module:
    if rule.kind == "vocab":
        assert isinstance(module, torch.nn.Embedding)
        shape = tuple(module.weight.shape)
        spec = TensorSlice.plan(f"{name}.weight", shape, 0, None, axis.size, axis.rank, 1, "rows")
        return vocab_parallel(module, axis, spec)
    w, bias = module.weight, module.bias
    assert isinstance(w, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    dim = _dim(module, rule)
    attention = heads is not None and bool(_ATTENTION.search(name))
    granule = heads.head_dim if attention and heads is not None else 1
    if rule.kind == "row":
        spec = TensorSlice.plan(
            f"{name}.weight", tuple(w.shape), dim, rule.sub_params(), axis.size, axis.rank,
            granule, unit="input features",
        )  # fmt: skip
        return LinearAllreduce(module, axis, spec)
    parts = _qkv_parts(name, w.shape[dim], heads) if rule.fused_qkv else rule.sub_params()
    gather = rule.kind == "column_gather"
    spec = TensorSlice.plan(
        f"{name}.weight", tuple(w.shape), dim, parts, axis.size, axis.rank,
        1 if gather else granule, unit="output features",
    )  # fmt: skip
    bias_spec = None
    if bias is not None:
        if dim != out_dim(module):
            raise plan.PlanError(
                f"{name}: a column-parallel cut of dim {dim} is not its output dim; a bias "
                "cannot follow it (check the spec's partition_dim)"
            )
        bias_spec = TensorSlice.plan(
            f"{name}.bias", tuple(bias.shape), 0, parts, axis.size, axis.rank,
            1 if gather else granule,
        )  # fmt: skip
    return LinearLayer(module, axis, spec, bias_spec, gather_output=gather)


def _set_child(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _localize(model: torch.nn.Module, names: list[str], size: int) -> None:
    """Parents of sliced attention projections see local widths and head counts."""
    parents = {n.rpartition(".")[0] for n in names if _ATTENTION.search(n)}
    for parent_name in parents:
        parent = model.get_submodule(parent_name) if parent_name else model
        for attr in _LOCAL_ATTRS:
            value = getattr(parent, attr, None)
            if type(value) is int and value % size == 0:
                setattr(parent, attr, value // size)
        _localize_config(parent, size)


def _localize_config(parent: torch.nn.Module, size: int) -> None:
    """An attention module that reads head counts from the model's shared config (Phi-3
    splits its fused q/k/v output at config.num_attention_heads * head_dim) gets a copy of
    it with this rank's counts; the other modules keep reading the whole model's."""
    cfg = getattr(parent, "config", None)
    counts = {a: getattr(cfg, a, None) for a in _LOCAL_ATTRS if a in _CONFIG_HEADS}
    local = {a: v // size for a, v in counts.items() if type(v) is int and v % size == 0}
    if cfg is None or not local:
        return
    own = copy.copy(cfg)
    for attr, value in local.items():
        setattr(own, attr, value)
    parent.config = own


def _fits(name: str, module: torch.nn.Module, rule: plan.LayerRule) -> bool:
    """Whether the matched module is of a kind the rule can cut (heuristics skip others)."""
    ok = isinstance(module, torch.nn.Embedding) if rule.kind == "vocab" else is_linear_like(module)
    if ok or rule.source == "heuristics":
        return ok
    what = "an embedding" if rule.kind == "vocab" else "linear layers (torch Linear, HF Conv1D)"
    raise plan.PlanError(
        f"{name} ({type(module).__name__}) matches {rule.source}, but only {what} can be cut "
        'that way here; narrow the pattern, or make the rule\'s partition_type "skip"'
    )


def _tied_left_whole(
    model: torch.nn.Module, chosen: list[tuple[str, torch.nn.Module, plan.LayerRule]], out: Sliced
) -> set[str]:
    """Names of chosen modules whose weight another module also holds, and that cannot be
    cut together: an embedding cut by vocabulary and a head with a gathered output cut
    along the same rows can (one cut, both modules); anything else stays whole, with
    every other holder (cutting one would untie it)."""
    holders: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    rule_of = {name: rule for name, _, rule in chosen}
    keep: set[str] = set()
    for name, module, _ in chosen:
        who = holders.get(id(module.weight), [name])
        if len(set(who)) == 1:
            continue
        kinds = {rule_of[n].kind if n in rule_of else None for n in who}
        together = kinds == {"vocab", "column_gather"} and not any(
            is_conv1d(model.get_submodule(n)) for n in who
        )
        if not together:
            keep.add(name)
    out.kept_whole = sorted(keep)
    return keep


def slice_model(
    model: torch.nn.Module,
    axis: AxisGroup,
    partition_config: dict[str, Any] | None = None,
    preset: str | None = None,
) -> Sliced:
    """Slice `model` in place over `axis` (collective over the tensor-parallel group)."""
    rules = plan.choose(model, partition_config, preset)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    heads = heads_of(model)
    out = Sliced()
    if axis.size == 1:
        return out
    _same_everywhere(model, axis)
    chosen: list[tuple[str, torch.nn.Module, plan.LayerRule]] = []
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        rule = plan.first_match(rules, (f"{name}.weight", name), model_type)
        if rule is None or rule.kind == "skip":
            continue
        if not _fits(name, module, rule):
            continue
        chosen.append((name, module, rule))
    keep = _tied_left_whole(model, chosen, out)
    for name, module, rule in chosen:
        if name in keep:
            continue
        _set_child(model, name, _slice_layer(name, module, rule, axis, heads))
        out.layers.append(name)
        out.sources.add(rule.source.split("[")[0])
    if not out.layers:
        raise plan.PlanError(
            f"tensor_parallel.autotp_size={axis.size}: no layer of {type(model).__name__} "
            "matched a slicing rule, so nothing would be split; give "
            "tensor_parallel.partition_config layer_specs (regexes over parameter names such "
            'as ".*\\\\.q_proj\\\\.weight$") or a preset_model'
        )
    _localize(model, out.layers, axis.size)
    if out.kept_whole:
        logger.info(
            f"AutoTP: {', '.join(out.kept_whole)} share their weight with another module "
            "that is not cut the same way; left whole"
        )
    return out


def replicated_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Trainable parameters every tensor-parallel rank holds whole (not marked with
    Megatron's `tensor_model_parallel`, which sliced layers here and Megatron's own set)."""
    return [
        p
        for p in model.parameters()
        if p.requires_grad and not getattr(p, "tensor_model_parallel", False)
    ]

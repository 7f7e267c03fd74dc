"""Optimizer state by parameter name: the form a checkpoint takes on its way to a different
layout (another number of pipeline stages: every stage's files are read, and each new stage
takes the parameters it now owns).

[Note: named optimizer state]
A NamedState maps each parameter's name to its fp32 master (full, flat), its optimizer state
(per-element tensors full and flat; per-step values such as `step` as saved), and its param
group's options. Stage 0 files hold per-parameter optimizer state keyed by index (the
`param_names` list, saved beside it, names them); ZeRO 1/2 files hold bucket chunks per data
rank, whose layouts name every slot ([Note: shard layout]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed_ext.utils.errors import CheckpointError

from .layout import GroupLayout
from .protocol import RankFiles
from .reshard import full_by_name, split_partition


@dataclass
class NamedState:
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def update(self, other: NamedState) -> None:
        self.masters.update(other.masters)
        self.state.update(other.state)
        self.options.update(other.options)


def from_stage0(
    model_state: dict[str, Any],
    param_names: list[list[str]],
    weights: dict[str, torch.Tensor],
    skip_missing: bool = False,
) -> NamedState:
    """A stage-0 model-states file; `weights` (the saved module) are the masters of an fp32
    model (a 16-bit model's masters are in the file). skip_missing: leave out the names with
    no master (MoE experts kept elsewhere: [Note: expert checkpoint files])."""
    out = NamedState()
    sd = model_state.get("optimizer")
    if sd is None:
        return out
    masters = model_state.get("master_weights") or weights
    for group, names in zip(sd["param_groups"], param_names):
        opts = {k: v for k, v in group.items() if k != "params"}
        for pid, name in zip(group["params"], names):
            if skip_missing and name not in masters:
                continue
            out.state[name] = {
                k: (v.reshape(-1) if is_per_element(k, v, masters[name].numel()) else v)
                for k, v in sd["state"].get(pid, {}).items()
            }
            out.options[name] = opts
            out.masters[name] = masters[name].float().reshape(-1)
    return out


def from_zero(files: RankFiles) -> NamedState:
    """The zero_pp_rank files of one model-parallel rank (ZeRO 1/2)."""
    first = files.read(0)
    parts = [files.read(r) for r in range(int(first["partition_count"]))]
    layouts = [GroupLayout.from_dict(d) for d in first["zero_layouts"]]
    saved = [p["optimizer_state_dict"] for p in parts]
    # where each layout's chunks sit in the optimizer: (param group, offset); a client
    # optimizer's group can hold several layouts'. Older files put each in the next group
    # that holds any (a client's group of frozen params only was left empty)
    place = first.get("zero_opt_place") or [
        (i, 0) for i, pg in enumerate(saved[0]["param_groups"]) if pg["params"]
    ]
    out = NamedState()
    for g, lay in enumerate(layouts):
        per_rank = [split_partition(lay, p["fp32_partitions"][g]) for p in parts]
        out.masters.update(full_by_name(lay, per_rank))
        i, at = place[g]
        n = len(lay.buckets)
        ids = [sd["param_groups"][i]["params"][at : at + n] for sd in saved]
        opts = {k: v for k, v in saved[0]["param_groups"][i].items() if k != "params"}
        chunk = lay.buckets[0].chunk(lay.world_size)
        template = saved[0]["state"].get(ids[0][0], {})
        for key, value in template.items():
            if torch.is_tensor(value) and key != "step" and value.numel() == chunk:
                chunks = [
                    [sd["state"][i[b]][key] for b in range(len(lay.buckets))]
                    for sd, i in zip(saved, ids)
                ]
                for name, t in full_by_name(lay, chunks).items():
                    out.state.setdefault(name, {})[key] = t
            else:
                for s in lay.slots:
                    out.state.setdefault(s.name, {})[key] = value
        for s in lay.slots:
            out.state.setdefault(s.name, {})  # empty before the first step: none to re-cut
            out.options[s.name] = opts
    return out


def missing_names(named: NamedState, names: list[str], where: Any) -> None:
    missing = [n for n in names if n not in named.masters or n not in named.state]
    if missing:
        raise CheckpointError(
            f"{where} holds no optimizer state for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: it was saved from another model; load "
            "it with load_optimizer_states=False to take the weights only"
        )


def own_copy(value: Any) -> Any:
    """A tensor that shares no storage with another holder (torch's Adam adds to its `step`
    tensor in place, per parameter; a saved value must not follow live training state)."""
    return value.detach().clone() if torch.is_tensor(value) else value


def is_per_element(key: str, value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and key != "step" and value.numel() == numel

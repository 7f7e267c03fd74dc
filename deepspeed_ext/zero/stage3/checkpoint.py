"""Stage-3 checkpoint contents (the files are the runtime's; this module fills and reads them).

[Note: stage-3 checkpoint]
Parameters live only as shards, so the model-states file holds the buffers and a parameter
table: (name, shape) in module order, the frozen ones, and tied aliases (a state_dict key
whose tensor is another name's parameter). Each rank's zero_pp_rank_* file holds, by name,
its shard of every parameter in the model dtype (`param_shards`), the fp32 master shard of
every trainable one (`fp32_masters`) and its optimizer state dict, whose per-parameter
entries are shard-sized. A shard is rank r's slice [r*S, (r+1)*S) of the flattened parameter
(S = ceil(numel / world), zero-padded), so the full tensor is the ranks' shards concatenated
and cut to numel: that is how zero_to_fp32 and a resume at another world size rebuild it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.utils.errors import CheckpointError

from ..named_state import own_copy
from ..protocol import RankFiles
from .param import own_slice, read_shard, shard_numel, write_shard

if TYPE_CHECKING:
    from .strategy import Stage3Strategy


def param_table(module: torch.nn.Module) -> dict[str, Any]:
    params: list[tuple[str, Any]] = list(module.named_parameters())
    canonical = {id(p): n for n, p in params}
    tied = {
        k: canonical[id(v)]
        for k, v in module.state_dict(keep_vars=True).items()
        if id(v) in canonical and canonical[id(v)] != k
    }
    return {
        "params": [(n, tuple(p.ds_shape)) for n, p in params],
        "frozen": [n for n, p in params if not p.requires_grad],
        "tied": tied,
    }


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict().items() if k not in names}


def rank_payload(s: Stage3Strategy, optimizer: Any) -> dict[str, Any]:
    named = list(s.module.named_parameters())
    with s.resident_optimizer():  # NVMe-offloaded masters and states, read back
        opt = optimizer.state_dict() if optimizer else None
        if opt is not None:  # copies: the swapper empties the live state on exit
            opt = {
                "state": {
                    k: {n: own_copy(v) for n, v in st.items()} for k, st in opt["state"].items()
                },
                "param_groups": opt["param_groups"],
            }
        masters = {
            n: own_copy(s.master_of(p).detach().cpu()) for n, p in named if id(p) in s.trainable_ids
        }
    return {
        "param_shards": {n: read_shard(p).detach().cpu() for n, p in named},
        "fp32_masters": masters,
        "optimizer_state_dict": opt,
        "zero_stage": 3,
        "partition_count": s.world,
    }


def full_from_shards(shards: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    return torch.cat([t.reshape(-1) for t in shards])[:numel].view(shape)


def check_stage3(state: dict[str, Any], files: RankFiles) -> None:
    if not state.get("zero3_params"):
        raise CheckpointError(
            f"{files.where} was written with zero_optimization.stage "
            f"{state.get('zero_stage')} and this engine runs stage 3: parameters "
            "partitioned by stage 3 load only into stage 3. Consolidate it with zero_to_fp32 "
            "and load the weights into the model instead"
        )
    first = files.read(0)
    if int(first.get("zero_stage") or 0) != 3:
        raise CheckpointError(
            f"{files.where} was not written by ZeRO stage 3; train with the stage it was saved with"
        )


class _Cut:
    """This rank's shard of a saved value: as saved at the same data-parallel size, else
    rebuilt from every saved rank's shard and re-cut."""

    def __init__(self, s: Stage3Strategy, state: dict[str, Any], files: RankFiles) -> None:
        self.s = s
        self.saved_world = int(files.read(0)["partition_count"])
        self.same = self.saved_world == s.world
        ranks = [s.rank] if self.same else list(range(self.saved_world))
        self.parts = [files.read(r) for r in ranks]
        self.shapes = dict(state["zero3_params"]["params"])

    def mine(self, key: str, name: str) -> torch.Tensor:
        if self.same:
            return self.parts[0][key][name]
        full = full_from_shards([p[key][name] for p in self.parts], self.shapes[name])
        return own_slice(full.reshape(-1), self.s.rank, self.s.world)


@torch.no_grad()
def load_whole_module(s: Stage3Strategy, state: dict[str, Any], files: RankFiles) -> None:
    """A checkpoint of another stage holds the whole module in its model-states file: each
    parameter's shard and fp32 master are cut from it (the optimizer state, laid out by
    that stage, is refused by load_optimizer unless the load takes the module only)."""
    saved = state["module"]
    named = dict(s.module.named_parameters())
    missing = [n for n in named if n not in saved]
    if missing:
        raise CheckpointError(
            f"{files.where} (zero_optimization.stage {state.get('zero_stage')}) has no saved "
            f"values for parameters {missing[:5]}: it was saved from another model"
        )
    s.module.load_state_dict({k: v for k, v in saved.items() if k not in named}, strict=False)
    for n, p in named.items():
        write_shard(p, own_slice(saved[n].reshape(-1).to(p.dtype), s.rank, s.world))
    with s.resident_optimizer():
        for n, p in named.items():
            if id(p) in s.trainable_ids:
                s.master_of(p).copy_(own_slice(saved[n].reshape(-1).float(), s.rank, s.world))
    s.after_load()  # kept-whole and gathered copies follow the new shards


@torch.no_grad()
def load_weights(s: Stage3Strategy, state: dict[str, Any], files: RankFiles) -> None:
    """Buffers, parameter shards and fp32 masters, re-cut when the size differs; from a
    checkpoint of another stage, cut from its whole module."""
    if not state.get("zero3_params") and isinstance(state.get("module"), dict):
        load_whole_module(s, state, files)
        return
    check_stage3(state, files)
    s.module.load_state_dict(state["module"], strict=False)  # the buffers
    cut = _Cut(s, state, files)
    named = list(s.module.named_parameters())
    missing = [n for n, _ in named if n not in cut.shapes]
    if missing:
        raise CheckpointError(f"{files.where} has no saved values for parameters {missing}")
    for n, p in named:
        write_shard(p, cut.mine("param_shards", n))
    with s.resident_optimizer():
        for n, p in named:
            if id(p) in s.trainable_ids:
                s.master_of(p).copy_(cut.mine("fp32_masters", n))
    s.after_load()


@torch.no_grad()
def load_optimizer(
    s: Stage3Strategy, optimizer: Any, state: dict[str, Any], files: RankFiles
) -> None:
    if not state.get("zero3_params"):  # another stage's state: its own layout
        raise CheckpointError(
            f"{files.where} was written with zero_optimization.stage "
            f"{state.get('zero_stage')} and this engine runs stage 3: its weights load (they "
            "did), its optimizer state does not. Pass load_optimizer_states=False (or "
            "load_module_only=True) to start the optimizer afresh from these weights, or "
            "resume with the stage that saved it"
        )
    cut = _Cut(s, state, files)
    with s.resident_optimizer():
        sd = cut.parts[0]["optimizer_state_dict"]
        if not cut.same:
            sd = _reshard_optimizer(s, [p["optimizer_state_dict"] for p in cut.parts], cut.shapes)
        optimizer.load_state_dict(sd)


def _reshard_optimizer(
    s: Stage3Strategy, saved: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Per-parameter optimizer states keep their index (the groups hold the same parameters
    in the same order at any size); shard-sized tensors are re-cut."""
    names = [s.param_name(p) for grp in s.group_params for p in grp]
    state: dict[int, dict[str, Any]] = {}
    for idx, entry in saved[0]["state"].items():
        name = names[int(idx)]
        numel = math.prod(shapes[name])
        old_shard = shard_numel(numel, len(saved))
        out: dict[str, Any] = {}
        for key, v in entry.items():
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == old_shard and key != "step":
                full = full_from_shards([sd["state"][idx][key] for sd in saved], shapes[name])
                out[key] = own_slice(full.reshape(-1), s.rank, s.world)
            else:
                out[key] = v
        state[int(idx)] = out
    return {"state": state, "param_groups": saved[0]["param_groups"]}

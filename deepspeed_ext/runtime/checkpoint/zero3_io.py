"""Stage-3 checkpoint contents (the files are engine_io's; this module fills and reads them).

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
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.zero.stage3.param import own_slice, read_shard, shard_numel, write_shard

from . import layout, safe_load
from .safe_load import CheckpointError


def param_table(engine: Any) -> dict[str, Any]:
    module = engine.module
    params = list(module.named_parameters())
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


def module_buffers(engine: Any) -> dict[str, torch.Tensor]:
    module = engine.module
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict().items() if k not in names}


def rank_payload(engine: Any) -> dict[str, Any]:
    s = engine.strategy
    named = list(engine.module.named_parameters())
    with s.resident_optimizer():  # NVMe-offloaded masters and states, read back
        opt = engine.optimizer.state_dict() if engine.optimizer else None
        if opt is not None:  # copies: the swapper empties the live state on exit
            opt = {
                "state": {k: {n: _own(v) for n, v in st.items()} for k, st in opt["state"].items()},
                "param_groups": opt["param_groups"],
            }
        masters = {
            n: _own(s.master_of(p).detach().cpu()) for n, p in named if id(p) in s.trainable_ids
        }
    return {
        "param_shards": {n: read_shard(p).detach().cpu() for n, p in named},
        "fp32_masters": masters,
        "optimizer_state_dict": opt,
        "zero_stage": 3,
        "partition_count": engine.dp_world_size,
    }


def _own(v: Any) -> Any:
    """A tensor that does not share storage with live training state."""
    return v.detach().clone() if torch.is_tensor(v) else v


def full_from_shards(shards: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    return torch.cat([t.reshape(-1) for t in shards])[:numel].view(shape)


@torch.no_grad()
def load(engine: Any, ckpt_dir: Path, state: dict[str, Any], load_optimizer: bool) -> None:
    """Shards, masters and (optionally) optimizer state from the saved ranks, re-cut when the
    world size differs."""
    rank, world, mp = engine.dp_rank, engine.dp_world_size, engine.layout.model.rank
    first = safe_load.load(ckpt_dir / layout.zero_optim_states_name(0, mp))
    if int(first.get("zero_stage") or 0) != 3:
        raise CheckpointError(
            f"{ckpt_dir} was not written by ZeRO stage 3; train with the stage it was saved with"
        )
    saved_world = int(first["partition_count"])
    same = saved_world == world
    ranks = [rank] if same else list(range(saved_world))
    parts = [
        first if r == 0 else safe_load.load(ckpt_dir / layout.zero_optim_states_name(r, mp))
        for r in ranks
    ]
    shapes = dict(state["zero3_params"]["params"])
    s = engine.strategy

    def mine(key: str, name: str) -> torch.Tensor:
        if same:
            return parts[0][key][name]
        full = full_from_shards([p[key][name] for p in parts], shapes[name])
        return own_slice(full.reshape(-1), rank, world)

    named = list(engine.module.named_parameters())
    missing = [n for n, _ in named if n not in shapes]
    if missing:
        raise CheckpointError(f"{ckpt_dir} has no saved values for parameters {missing}")
    for n, p in named:
        write_shard(p, mine("param_shards", n))
    with s.resident_optimizer():
        for n, p in named:
            if id(p) in s.trainable_ids:
                s.master_of(p).copy_(mine("fp32_masters", n))
        if load_optimizer and engine.optimizer is not None:
            sd = parts[0]["optimizer_state_dict"]
            if not same:
                sd = _reshard_optimizer(engine, [p["optimizer_state_dict"] for p in parts], shapes)
            engine.optimizer.load_state_dict(sd)
    s.after_load()


def _reshard_optimizer(
    engine: Any, saved: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Per-parameter optimizer states keep their index (the groups hold the same parameters
    in the same order at any world size); shard-sized tensors are re-cut."""
    rank, world = engine.dp_rank, engine.dp_world_size
    s = engine.strategy
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
                out[key] = own_slice(full.reshape(-1), rank, world)
            else:
                out[key] = v
        state[int(idx)] = out
    return {"state": state, "param_groups": saved[0]["param_groups"]}

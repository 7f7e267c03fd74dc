"""ZeRO 1/2 checkpoint contents: each data-parallel rank's file holds its fp32 master
partition and its optimizer state (per bucket chunk); a resume at another data-parallel size
re-cuts both by parameter name (reshard.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.version import __version__

from .layout import GroupLayout
from .protocol import RankFiles
from .reshard import chunks_for, full_by_name, split_partition

if TYPE_CHECKING:
    from .strategy import ZeroStrategy


def rank_state(s: ZeroStrategy, optimizer: Any) -> dict[str, Any]:
    return {
        "optimizer_state_dict": optimizer.state_dict(),
        "fp32_partitions": s.master_partitions(),
        "zero_stage": s.stage,
        "partition_count": s.world,
        "zero_layouts": s.layouts(),
        "ds_version": __version__,
    }


def load_partitions(
    s: ZeroStrategy, optimizer: Any, state: dict[str, Any], files: RankFiles
) -> None:
    if int(state.get("zero_stage") or 0) == 0:
        raise CheckpointError(
            f"{files.where} was written without ZeRO (stage 0); load it with "
            "load_optimizer_states=False, or train with the stage it was saved with"
        )
    first = files.read(0)
    saved_world = int(first["partition_count"])
    if saved_world != s.world:
        _load_resharded(s, optimizer, files, saved_world)
        return
    part = files.read(s.rank)
    s.check_layouts(part["zero_layouts"])
    optimizer.load_state_dict(part["optimizer_state_dict"])
    s.load_master_partitions(part["fp32_partitions"])


def _load_resharded(s: ZeroStrategy, optimizer: Any, files: RankFiles, saved_world: int) -> None:
    """Partitions written by `saved_world` ranks, re-cut for this data-parallel size. Every
    rank reads every saved partition: memory is one full copy of a state at a time."""
    parts = [files.read(r) for r in range(saved_world)]
    old_layouts = [GroupLayout.from_dict(d) for d in parts[0]["zero_layouts"]]
    new_layouts = s.group_layouts()
    s.check_names(old_layouts)
    masters = []
    for g, (old, new) in enumerate(zip(old_layouts, new_layouts)):
        per_rank = [split_partition(old, p["fp32_partitions"][g]) for p in parts]
        masters.append(torch.cat(chunks_for(new, s.rank, full_by_name(old, per_rank))))
    saved = [p["optimizer_state_dict"] for p in parts]
    current = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for g, (old, new) in enumerate(zip(old_layouts, new_layouts)):
        old_ids = [sd["param_groups"][g]["params"] for sd in saved]
        new_ids = current["param_groups"][g]["params"]
        template = saved[0]["state"].get(old_ids[0][0], {})
        for key, value in template.items():
            chunked = (
                torch.is_tensor(value)
                and key != "step"
                and value.dim() == 1
                and value.numel() == old.buckets[0].chunk(old.world_size)
            )
            if chunked:
                per_rank = [
                    [sd["state"][ids[b]][key] for b in range(len(old.buckets))]
                    for sd, ids in zip(saved, old_ids)
                ]
                new_chunks = chunks_for(new, s.rank, full_by_name(old, per_rank))
                for pid, chunk in zip(new_ids, new_chunks):
                    state.setdefault(pid, {})[key] = chunk
            else:  # per-step scalars (e.g. the step count) are the same for every chunk
                for pid in new_ids:
                    state.setdefault(pid, {})[key] = value
    groups = [
        {**{k: v for k, v in spg.items() if k != "params"}, "params": cpg["params"]}
        for spg, cpg in zip(saved[0]["param_groups"], current["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    s.load_master_partitions(masters)
    logger.info(
        f"resharded ZeRO checkpoint {files.where} from {saved_world} to {s.world} "
        "data-parallel ranks"
    )

"""ZeRO 1/2 checkpoint contents: each data-parallel rank's file holds its fp32 master
partition and its optimizer state (per bucket chunk); a resume at another data-parallel size
re-cuts both by parameter name (reshard.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.version import __version__

from .layout import GroupLayout
from .named_state import from_zero
from .protocol import RankFiles

if TYPE_CHECKING:
    from .strategy import ZeroStrategy


def rank_state(s: ZeroStrategy, optimizer: Any) -> dict[str, Any]:
    out = {
        "optimizer_state_dict": _dense_state_dict(s, optimizer),
        "fp32_partitions": s.master_partitions(),
        "zero_stage": s.stage,
        "partition_count": s.world,
        "zero_layouts": s.layouts(),
        "zero_opt_place": [list(x) for x in saved_place(s)],  # each layout's optimizer group
        "ds_version": __version__,
    }
    if s.exchange is not None:  # gradient_compression's error buffers: this rank's own
        out["grad_exchange"] = s.exchange.state_dict()
    return out


def saved_place(s: ZeroStrategy) -> list[tuple[int, int]]:
    """Where the rank file's groups sit in the optimizer: (param group, offset)."""
    return [s.opt_place[g] for g in s.saved_groups()]


def _dense_state_dict(s: ZeroStrategy, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict without the state of spread experts' groups (kept in
    their own files: [Note: ZeRO with spread experts])."""
    sd = optimizer.state_dict()
    kept = set(s.saved_groups())
    drop: set[int] = set()
    for g, grp in enumerate(s.groups):
        if g not in kept:
            i, at = s.opt_place[g]
            drop.update(sd["param_groups"][i]["params"][at : at + len(grp.masters)])
    if drop:
        sd = {**sd, "state": {k: v for k, v in sd["state"].items() if k not in drop}}
    return sd


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
    place = first.get("zero_opt_place")  # None: written before it was recorded
    if place is not None and [tuple(x) for x in place] != saved_place(s):
        raise CheckpointError(
            f"{files.where}: its optimizer state was written for other optimizer param "
            "groups than this optimizer's (another optimizer object, or the config's "
            "optimizer): build the optimizer as the saving run did, or load with "
            "load_optimizer_states=False"
        )
    if saved_world != s.world:
        _load_resharded(s, optimizer, files, saved_world)
        return
    part = files.read(s.rank)
    s.check_layouts(part["zero_layouts"])
    optimizer.load_state_dict(part["optimizer_state_dict"])
    s.load_master_partitions(part["fp32_partitions"])
    if s.exchange is not None and not s.exchange.load_state_dict(part.get("grad_exchange")):
        errors_restart(files.where, s.rank, s.world)


def _load_resharded(s: ZeroStrategy, optimizer: Any, files: RankFiles, saved_world: int) -> None:
    """Partitions written by `saved_world` ranks, re-cut for this data-parallel size by
    parameter name ([Note: named optimizer state]). Every rank reads every saved partition:
    memory is one full copy of the state."""
    first = files.read(0)
    s.check_names([GroupLayout.from_dict(d) for d in first["zero_layouts"]])
    s.load_named_state(optimizer, from_zero(files), files.where)
    if s.exchange is not None:
        s.exchange.load_state_dict(None)
        errors_restart(files.where, s.rank, s.world)
    logger.info(
        f"resharded ZeRO checkpoint {files.where} from {saved_world} to {s.world} "
        "data-parallel ranks"
    )


def errors_restart(where: Any, rank: int, world: int) -> None:
    """A resume without this rank's error-feedback buffers (none saved at this world size)."""
    logger.warning(
        f"{where}: no per-rank state for data-parallel rank {rank} at this world size "
        f"({world}); the compressed exchange's error-feedback buffers restart at zero"
    )

"""The environment every rank starts with, the world description handed between launchers,
and `.deepspeed_env` (KEY=VALUE lines exported to every rank)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deepspeed_ext.utils import numa

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
# Read in this order, so a project's ./.deepspeed_env overrides the one in $HOME.
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]


class EnvFileError(ValueError):
    """A .deepspeed_env line that is not KEY=VALUE."""


def read_deepspeed_env(paths: Sequence[str] | None = None) -> dict[str, str]:
    """Variables from every `.deepspeed_env` found in `paths` (later files win)."""
    found: dict[str, str] = {}
    for folder in DEEPSPEED_ENVIRONMENT_PATHS if paths is None else paths:
        path = os.path.join(folder, DEEPSPEED_ENVIRONMENT_NAME)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for number, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, eq, value = line.partition("=")
                if not eq or not key.strip():
                    raise EnvFileError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
                found[key.strip()] = value.strip()
    return found


def encode_world_info(world_info: Mapping[str, Sequence[int]]) -> str:
    """host -> slot ids as urlsafe base64 JSON (one shell-safe argument, as upstream)."""
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode()).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    return {
        str(h): [int(s) for s in slots]
        for h, slots in json.loads(base64.urlsafe_b64decode(text)).items()
    }


@dataclass(frozen=True)
class NodePlan:
    """What one node launches: its share of the world and where rank 0 listens."""

    world_info: dict[str, list[int]]  # host -> slot ids, in global rank order
    node_rank: int
    master_addr: str
    master_port: int
    # CUDA_VISIBLE_DEVICES entries for this node's ranks (LOCAL_RANK indexes them);
    # None: CPU ranks, and CUDA_VISIBLE_DEVICES is left as the user set it
    devices: list[str] | None = None

    @property
    def hosts(self) -> list[str]:
        return list(self.world_info)

    @property
    def local_size(self) -> int:
        return len(self.world_info[self.hosts[self.node_rank]])

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.world_info.values())

    def global_rank(self, local_rank: int) -> int:
        before = sum(len(self.world_info[h]) for h in self.hosts[: self.node_rank])
        return before + local_rank


def rank_env(base: Mapping[str, str], plan: NodePlan, local_rank: int) -> dict[str, str]:
    """The environment of one rank: `base` plus the torch.distributed / DeepSpeed contract."""
    env = dict(base)
    env.update(
        RANK=str(plan.global_rank(local_rank)),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(plan.local_size),
        LOCAL_SIZE=str(plan.local_size),  # upstream's name for LOCAL_WORLD_SIZE
        CROSS_RANK=str(plan.node_rank),
        CROSS_SIZE=str(len(plan.world_info)),
        MASTER_ADDR=plan.master_addr,
        MASTER_PORT=str(plan.master_port),
    )
    if plan.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(plan.devices)
    if "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(plan.local_size))
    return env


def threads_per_rank(local_size: int) -> int:
    """The node's cores shared out among its ranks, unless the user set OMP_NUM_THREADS.

    Every rank's torch (and OpenMP, which spins while waiting) otherwise takes all cores:
    N ranks on C cores would run N*C threads and crawl.
    """
    return max(1, len(numa.available_cores()) // max(1, local_size))

"""Who am I in the job: rank, world size, local rank and rendezvous from the environment.

Sources, in order: the env contract (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, set
by our launcher and by torchrun), Slurm (SLURM_PROCID, ...), and the MPI launchers: Open MPI
(OMPI_COMM_WORLD_*), MVAPICH (MV2_COMM_WORLD_*), MPICH and Intel MPI (PMI_RANK/PMI_SIZE).
None of them: a single process, world size 1.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # which variables it came from, for error messages

    def export(self) -> None:
        """Write the env contract, so torch.distributed's env:// and user code agree."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'node[03-05,9],gpu1' -> 'node03'."""
    m = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _int(env: dict[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


# (rank, size, local rank, local size, what to call them) per MPI launcher
_MPI_VARS = [
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "Open MPI",
    ),
    (
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "MVAPICH",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH/Intel MPI"),
]


def _from_mpi(
    e: dict[str, str],
    rank_key: str,
    size_key: str,
    local_key: str,
    local_size_key: str,
    name: str,
    port: int,
) -> DistEnv:
    size = _int(e, size_key)
    local_size = int(e.get(local_size_key, e.get("LOCAL_SIZE", size)))
    addr = e.get("MASTER_ADDR") or ""
    if not addr:
        if local_size != size:
            raise ValueError(
                f"{name} job across nodes without MASTER_ADDR: export MASTER_ADDR=<rank 0's "
                "host> (and MASTER_PORT) to every rank (the deepspeed launcher does)"
            )
        addr = "127.0.0.1"
    return DistEnv(
        _int(e, rank_key), size, int(e.get(local_key, "0")), addr, port, f"{name} ({rank_key})"
    )


def discover(
    env: dict[str, str] | None = None, default_port: int = 29500, auto_mpi_discovery: bool = True
) -> DistEnv:
    e = dict(os.environ if env is None else env)
    port = int(e.get("MASTER_PORT", default_port))
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistEnv(
            _int(e, "RANK"),
            _int(e, "WORLD_SIZE"),
            int(e.get("LOCAL_RANK", "0")),
            e.get("MASTER_ADDR", "127.0.0.1"),
            port,
            "RANK/WORLD_SIZE",
        )
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        addr = e.get("MASTER_ADDR") or first_slurm_host(e.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return DistEnv(
            _int(e, "SLURM_PROCID"),
            _int(e, "SLURM_NTASKS"),
            int(e.get("SLURM_LOCALID", "0")),
            addr,
            port,
            "SLURM_PROCID/SLURM_NTASKS",
        )
    if auto_mpi_discovery:
        for rank_key, size_key, local_key, local_size_key, name in _MPI_VARS:
            if rank_key in e and size_key in e:
                return _from_mpi(e, rank_key, size_key, local_key, local_size_key, name, port)
    # A plain `python train.py`: a world of one on a private port.
    return DistEnv(0, 1, 0, "127.0.0.1", int(e.get("MASTER_PORT", free_port())), "single process")

"""CPU cores and NUMA nodes for binding ranks to cores (upstream's deepspeed.utils.numa), read
from Linux's /sys, so neither numactl nor psutil is needed to find them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_NODES = Path("/sys/devices/system/node")


def parse_range(rng: str) -> range:
    """'3' or '2-5' (inclusive) -> a range; anything else is a ValueError naming it."""
    text = rng.strip()
    try:
        if "-" not in text:
            value = int(text)
            if value < 0:
                raise ValueError
            return range(value, value + 1)
        start_s, end_s = text.split("-", 1)
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise ValueError(f"core range {rng!r}: expected N or N-M with 0 <= N <= M") from None
    if start < 0 or end < start:
        raise ValueError(f"core range {rng!r}: expected N-M with 0 <= N <= M")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; overlaps and disorder are errors, since a
    core given twice would be given to two ranks."""
    out: list[int] = []
    for part in range_str.split(","):
        r = parse_range(part)
        if out and r.start <= out[-1]:
            raise ValueError(
                f"core list {range_str!r}: ranges must ascend without overlap (at {part!r})"
            )
        out.extend(r)
    return out


def get_numa_cores() -> list[list[int]]:
    """The cores of each NUMA node, by node id (an empty list for a memory-only node, such as
    HBM in flat mode); [] when the system says nothing of its nodes."""
    if not _NODES.is_dir():
        return []
    nodes: dict[int, list[int]] = {}
    for d in _NODES.glob("node[0-9]*"):
        text = (d / "cpulist").read_text().strip() if (d / "cpulist").exists() else ""
        nodes[int(d.name[4:])] = parse_range_list(text) if text else []
    return [nodes.get(i, []) for i in range(max(nodes) + 1)] if nodes else []


def check_for_numactl_pkg() -> bool:
    """Whether numactl is installed (on PATH)."""
    return shutil.which("numactl") is not None


def available_cores() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cores_for_rank(
    bind_core_list: str | None, num_local_procs: int, local_rank: int
) -> tuple[int, list[int]]:
    """(cores per rank, this rank's cores): the list (default: every core this process may
    use) cut into equal consecutive shares, one per local rank; leftover cores stay unused."""
    cores = parse_range_list(bind_core_list) if bind_core_list else available_cores()
    per_rank = len(cores) // num_local_procs
    if per_rank < 1:
        raise ValueError(
            f"{len(cores)} core(s) for {num_local_procs} rank(s): each rank needs at least one "
            "(give more cores with --bind_core_list, or start fewer ranks)"
        )
    return per_rank, cores[per_rank * local_rank : per_rank * (local_rank + 1)]


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def get_numactl_cmd(
    bind_core_list: str | None, num_local_procs: int, local_rank: int
) -> tuple[int, list[str]]:
    """(cores per rank, the numactl prefix binding this rank's cores, and its memory to the
    NUMA node holding them, or to a memory-only node paired with it (preferred, as upstream
    does for flat HBM))."""
    if not check_for_numactl_pkg():
        raise ValueError("numactl is not installed; install it (e.g. apt install numactl)")
    if "KMP_AFFINITY" in os.environ:
        raise ValueError("KMP_AFFINITY is set, and it overrides numactl's core binding: unset it")
    per_rank, mine = cores_for_rank(bind_core_list, num_local_procs, local_rank)
    cmd = ["numactl"]
    numa = get_numa_cores()
    with_cores = [i for i, c in enumerate(numa) if c]
    memory_only = [i for i, c in enumerate(numa) if not c]
    for i in with_cores:
        if set(mine) <= set(numa[i]):
            if memory_only and len(memory_only) == len(with_cores):  # flat HBM: prefer it
                cmd += ["-p", str(memory_only[with_cores.index(i)])]
            else:
                cmd += ["-m", str(i)]
            break
    return per_rank, [*cmd, "-C", format_cores(mine)]

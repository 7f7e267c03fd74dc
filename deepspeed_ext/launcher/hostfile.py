"""The MPI-style hostfile (`worker-0 slots=4`) and the --include/--exclude resource filters.

A resource pool maps host -> slot count (hostfile order kept: it decides the rank order).
Active resources map host -> the slot ids to use, in rank order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

# `host slots=N`, anything after it only when it is a comment
_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*(?:#.*)?$")

NODE_SEP = "@"
SLOTS_START = ":"
SLOT_SEP = ","


class HostfileError(ValueError):
    """A hostfile or an --include/--exclude string that cannot be used."""


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> dict[str, int]:
    """host -> slots from hostfile lines; blank lines and `#` comments are skipped."""
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENTRY.match(line)
        if match is None:
            raise HostfileError(
                f"{source}:{number}: bad entry {line!r}; expected `<host> slots=<count>`"
            )
        host = match["host"]
        if host in pool:
            raise HostfileError(f"{source}:{number}: host {host!r} is listed twice")
        pool[host] = int(match["slots"])
        if pool[host] < 1:
            raise HostfileError(
                f"{source}:{number}: host {host!r} has slots=0: give it 1 or more, or remove "
                "the line"
            )
    if not pool:
        raise HostfileError(f"{source} lists no hosts (expected lines like `worker-0 slots=4`)")
    return pool


def fetch_hostfile(path: str) -> dict[str, int] | None:
    """The pool in the hostfile at `path`, or None when there is no such file (local run)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return parse_hostfile(f, source=path)


def _parse_spec(spec: str, pool: Mapping[str, list[int]]) -> list[tuple[str, list[int] | None]]:
    """`h1:0,1@h2` -> [("h1", [0, 1]), ("h2", None)]; None means every slot of the host."""
    out: list[tuple[str, list[int] | None]] = []
    for node in spec.split(NODE_SEP):
        host, has_slots, slot_text = node.partition(SLOTS_START)
        if host not in pool:
            known = ", ".join(pool) or "none"
            raise HostfileError(f"host {host!r} in {spec!r} is not in the pool (hosts: {known})")
        if not has_slots:
            out.append((host, None))
            continue
        try:
            slots = [int(s) for s in slot_text.split(SLOT_SEP)]
        except ValueError:
            raise HostfileError(
                f"bad slot list {slot_text!r} in {spec!r}; expected e.g. `{host}:0,1`"
            ) from None
        for slot in slots:
            if slot not in pool[host]:
                raise HostfileError(
                    f"no slot {slot} on host {host!r} (slots: {pool[host]}) in {spec!r}"
                )
        out.append((host, slots))
    return out


def _dedup(xs: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(xs))


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """Apply NODE_SPEC[@NODE_SPEC...] (NODE_SPEC = NAME[:SLOT[,SLOT...]]) to host -> slots.

    --include keeps only what it names (slots in the order given); --exclude drops what it
    names (a bare host drops the whole host). Hosts left empty disappear; the pool's host
    order is kept either way, since it decides which ranks land where.
    """
    if include_str and exclude_str:
        raise HostfileError("--include and --exclude are mutually exclusive")
    if not include_str and not exclude_str:
        return {h: list(s) for h, s in host_info.items()}

    if include_str:
        chosen: dict[str, list[int]] = {}
        for host, slots in _parse_spec(include_str, host_info):
            chosen[host] = chosen.get(host, []) + list(host_info[host] if slots is None else slots)
    else:
        chosen = {h: list(s) for h, s in host_info.items()}
        for host, slots in _parse_spec(exclude_str, host_info):
            drop = set(host_info[host] if slots is None else slots)
            chosen[host] = [s for s in chosen[host] if s not in drop]

    return {h: _dedup(chosen[h]) for h in host_info if chosen.get(h)}


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str = "", exclusion: str = ""
) -> dict[str, list[int]]:
    """Slot ids 0..slots-1 per host of a hostfile pool, then the include/exclude filter."""
    ids = {host: list(range(n)) for host, n in resource_pool.items()}
    return parse_resource_filter(ids, include_str=inclusion, exclude_str=exclusion)

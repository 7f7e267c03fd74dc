"""Two network namespaces joined by a veth pair, with a `tc` rate limit: a bandwidth-limited
"inter-node" link on one machine, made on entry and removed on exit (also after a crash of
the body). Needs root (ip netns, tc). Traffic stays inside the namespaces."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]  # each namespace's end of the veth pair
    addresses: tuple[str, str]
    rate: str | None

    def run_in(self, i: int, argv: list[str], **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *argv], **kwargs)  # type: ignore[call-overload]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    probe = f"dsx-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def linked_pair(tag: str, rate: str | None = "1gbit", subnet: str = "10.77.0") -> Iterator[Link]:
    a, b = f"dsx-{tag}-a", f"dsx-{tag}-b"
    va, vb = f"dsx{tag[:6]}a", f"dsx{tag[:6]}b"  # interface names: 15 characters at most
    for ns in (a, b):
        _ip("netns", "del", ns, check=False)  # a leftover of a killed run
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, host in ((a, va, 1), (b, vb, 2)):
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate:  # each end shapes what it sends: the link's rate both ways
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        "256kb",
                        "latency",
                        "100ms",
                    ],
                    check=True,
                    capture_output=True,
                )
        yield Link((a, b), (va, vb), (f"{subnet}.1", f"{subnet}.2"), rate)
    finally:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)  # takes the veth pair with it


def start_ranks(
    link: Link | None, per_node: int, argv: list[str], port: int
) -> list[subprocess.Popen]:
    """2 x per_node ranks of `argv` (a torch.distributed job with the env contract): node i
    runs ranks i*per_node.. in namespace i, its gloo traffic on its end of the link; with no
    link, all on loopback."""
    procs = []
    for rank in range(2 * per_node):
        node = rank // per_node
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(2 * per_node),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": link.addresses[0] if link else "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        if link:
            env["GLOO_SOCKET_IFNAME"] = link.interfaces[node]
        procs.append(link.run_in(node, argv, env=env) if link else subprocess.Popen(argv, env=env))
    return procs


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> None:
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")

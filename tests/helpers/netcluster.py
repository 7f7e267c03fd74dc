"""A throw-away cluster on this machine: N network namespaces ("hosts") on one bridge, each
running its own sshd (Debian's openssh-server) that accepts one throw-away key. Made on entry,
torn down on exit: sshd and every process left in a namespace are killed, then the namespaces
and the bridge are deleted. Traffic stays on the bridge and loopback.

The launcher under test runs in the root namespace and reaches the hosts by ssh, as it would
reach real nodes; the hosts share this machine's file system (same python, same checkout).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

IFNAME = "dsx0"  # each host's interface has the same name, so GLOO_SOCKET_IFNAME fits all


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


PACKAGES = ["openssh-server", "openssh-client", "pdsh"]  # Debian's


def _missing_tools() -> list[str]:
    tools = ("ip", "sshd", "ssh", "ssh-keygen", "pdsh")
    return [t for t in tools if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]


def _install_packages(packages: Sequence[str] = PACKAGES) -> str | None:
    """apt-get install the packages (a fresh CI machine has none); None, or why it failed."""
    if shutil.which("apt-get") is None:
        return "no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    for attempt in (install, ["apt-get", "update", "-q"], install):
        r = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode == 0 and attempt is install:
            return None
    return f"apt-get install {' '.join(packages)} failed: {r.stderr.strip()[-300:]}"


def openmpi_unavailable() -> str | None:
    """None when Open MPI's mpirun is here (installing Debian's openmpi-bin if needed)."""
    if shutil.which("ompi_info") is None:
        why = _install_packages(["openmpi-bin"])
        if why is not None or shutil.which("ompi_info") is None:
            return f"needs Open MPI: {why}"
    return None


def unavailable() -> str | None:
    """None when a cluster can be made here (installing the packages if needed), else why not
    (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if _missing_tools():
        why = _install_packages()
        if why is not None or _missing_tools():
            return f"needs {', '.join(_missing_tools())}: {why}"
    probe = f"dsxprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Cluster:
    """`hosts[i]` is host i's address (what a hostfile names); `ssh_args` reach any host."""

    tag: str
    workdir: Path
    hosts: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    bridge_addr: str = ""

    @property
    def key(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def ssh_args(self) -> list[str]:
        """Client options for this cluster's throw-away key (none of root's own ssh setup)."""
        return [
            "-i",
            str(self.key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
        ]

    def run_in(self, i: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *argv], **kwargs)  # type: ignore[call-overload]

    def pids(self, i: int) -> list[int]:
        """Processes whose network namespace is host i's (its sshd excluded)."""
        out = _ip("netns", "pids", self.namespaces[i], check=False).stdout.split()
        sshd = set(self._sshd_pids(i))
        return [int(p) for p in out if int(p) not in sshd]

    def processes(self, i: int) -> list[str]:
        """`pid args` of each process in host i's namespace other than sshd."""
        found = []
        for pid in self.pids(i):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and "sshd" not in args.split(" ")[0]:
                found.append(f"{pid} {args.strip()}")
        return found

    def _sshd_pids(self, i: int) -> list[int]:
        path = self.workdir / f"sshd{i}.pid"
        try:
            return [int(path.read_text().split()[0])]
        except (OSError, ValueError, IndexError):
            return []

    @property
    def subnet(self) -> str:
        return self.bridge_addr.rsplit(".", 1)[0] + ".0/24"

    def openmpi_env(self) -> dict[str, str]:
        """mpirun as root, over this cluster's ssh key, talking on the bridge's subnet."""
        return {
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_plm_rsh_args": " ".join(self.ssh_args),
            "OMPI_MCA_oob_tcp_if_include": self.subnet,
            "OMPI_MCA_btl_tcp_if_include": self.subnet,
        }

    def shape(self, i: int, rate: str) -> None:
        """Rate-limit what host i sends (tc tbf), to make a slow inter-node link."""
        subprocess.run(
            ["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "replace", "dev", IFNAME]
            + ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"],
            check=True,
            capture_output=True,
        )


def _subnet(tag: str) -> str:
    used = _ip("-4", "addr", check=False).stdout
    start = zlib.crc32(tag.encode()) % 200 + 20
    for k in [*range(start, 250), *range(20, start)]:
        if f"10.214.{k}." not in used:
            return f"10.214.{k}"
    raise RuntimeError("no free 10.214.x.0/24 subnet for the test cluster")


def _sshd_config(cluster: Cluster, i: int, addr: str) -> Path:
    path = cluster.workdir / f"sshd{i}.conf"
    path.write_text(
        "\n".join(
            [
                f"ListenAddress {addr}",
                "Port 22",
                f"HostKey {cluster.workdir / 'host_key'}",
                f"PidFile {cluster.workdir / f'sshd{i}.pid'}",
                f"AuthorizedKeysFile {cluster.workdir / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "LogLevel ERROR",
                "MaxStartups 64",
                "",
            ]
        )
    )
    return path


def start(tag: str, n_hosts: int, workdir: Path) -> Cluster:
    """Make the cluster (tear it down with stop(), also when this raises half way)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(tag, workdir)
    try:
        _start(cluster, n_hosts)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _start(cluster: Cluster, n_hosts: int) -> None:
    tag, workdir = cluster.tag, cluster.workdir
    for key in (cluster.key, workdir / "host_key"):
        for old in (key, Path(f"{key}.pub")):
            old.unlink(missing_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
            check=True,
            capture_output=True,
        )
    shutil.copy(f"{cluster.key}.pub", workdir / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    subnet = _subnet(tag)
    bridge = f"dsx{tag}br"
    _ip("link", "add", bridge, "type", "bridge")
    cluster.bridge_addr = f"{subnet}.1"
    _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    for i in range(n_hosts):
        ns, veth, addr = f"dsx{tag}h{i}", f"dsx{tag}v{i}", f"{subnet}.{i + 2}"
        _ip("netns", "add", ns)
        cluster.namespaces.append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        _ip("link", "set", veth, "master", bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        conf = _sshd_config(cluster, i, addr)
        subprocess.run(
            ["ip", "netns", "exec", ns, shutil.which("sshd") or "/usr/sbin/sshd", "-f", str(conf)]
            + ["-E", str(workdir / f"sshd{i}.log")],
            check=True,
            capture_output=True,
        )
        cluster.hosts.append(addr)
    _wait_for_ssh(cluster)


def _wait_for_ssh(cluster: Cluster, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for host in cluster.hosts:
        while True:
            r = subprocess.run(
                ["ssh", *cluster.ssh_args, "-o", "BatchMode=yes", host, "true"],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host} did not answer: {r.stderr.strip()}")
            time.sleep(0.2)


def stop(cluster: Cluster) -> None:
    """Kill everything in the namespaces (sshd too), delete them, the veths and the bridge."""
    killed: list[int] = []
    for i in range(len(cluster.namespaces)):
        for pid in cluster.pids(i) + cluster._sshd_pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0  # a namespace outlives `netns del` while it has members
    while any(Path(f"/proc/{pid}").exists() for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    for i, ns in enumerate(cluster.namespaces):
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"dsx{cluster.tag}v{i}", check=False)
    _ip("link", "del", f"dsx{cluster.tag}br", check=False)

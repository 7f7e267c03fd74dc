"""The master port: the requested one when it is free, else one the kernel hands out."""

from __future__ import annotations

import socket

DEFAULT_MASTER_PORT = 29500  # torch.distributed's default, as upstream


def port_in_use(port: int) -> bool:
    """Whether binding `port` on every interface fails (a listener, or a socket bound to it).

    SO_REUSEADDR, as rank 0's TCPStore binds: a port left in TIME_WAIT by the last job is
    free to it, and moving off a port the user named would be for nothing.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"--master_port {port}: a port is 0-65535 (0: any free port)")


def choose_master_port(requested: int) -> tuple[int, str | None]:
    """(port to use, a one-line note when we had to move off the requested one). Port 0
    means any free port: passed through, rank 0's store would bind a random port and every
    other rank would wait forever to connect to port 0."""
    check_port(requested)
    if requested == 0:
        return free_port(), None
    if not port_in_use(requested):
        return requested, None
    port = free_port()
    return port, f"master port {requested} is in use; using free port {port}"

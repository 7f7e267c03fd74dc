"""[Note: job control channel] How a multi-node job stops as one.

pdsh/ssh only start the per-node launchers; they cannot stop a job. A rank failing on one host
would leave every other host's ranks blocked in a collective until a timeout, and killing the
runner (or ssh) leaves remote processes running. So the runner listens on a TCP port and each
node's launcher (`launch.py --control`) keeps one connection to it:

- node -> runner: `hello` (with the job's token), then `failed` (rank, host, exit, stderr tail)
  the moment a rank fails, or `done` with the node's exit code;
- runner -> nodes: `ping` every PING_S, and `stop` when any node failed, was lost, or the
  runner was told to stop;
- a node that hears nothing for LOST_S (runner killed, network gone) or sees the connection
  close stops its ranks; the runner treats a connection that closes before `done` as a lost
  node and stops the rest.

Messages are JSON lines. The token only keeps stray connections out; it is not a secret.
"""

from __future__ import annotations

import json
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PING_S = 1.0
LOST_S = 10.0  # silence after which either side counts the other as gone
CONNECT_S = 30.0  # how long a node keeps trying to reach the runner


_SEND_LOCK = threading.Lock()  # pings and reports from two threads: whole lines, never mixed


def _send(sock: socket.socket, message: dict[str, Any]) -> bool:
    try:
        with _SEND_LOCK:
            sock.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        return False
    return True


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _lines(sock: socket.socket) -> Any:
    """Decoded messages from `sock` until it closes (or sends something undecodable)."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                yield json.loads(line)
            except ValueError:
                return


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (what that host can reach us at)."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class Event:
    kind: str  # "hello", "failed", "done" or "lost"
    node: int
    data: dict[str, Any]


class ControlServer:
    """The runner's side: one connection per node; events arrive on `events`."""

    def __init__(self, hosts: Sequence[str], bind: str = "0.0.0.0") -> None:
        self.hosts = list(hosts)
        self.token = secrets.token_hex(16)
        self.events: queue.Queue[Event] = queue.Queue()
        self._listener = socket.create_server((bind, 0))
        self.port = int(self._listener.getsockname()[1])
        self._conns: dict[int, socket.socket] = {}
        self._heard: dict[int, float] = {}  # node -> when it last sent anything
        self._stop_reason: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._ping, daemon=True).start()

    def address(self) -> str:
        """`--control` for the node launchers: where the first host reaches us, and the token."""
        return f"{local_address_towards(self.hosts[0])}:{self.port}:{self.token}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        messages = _lines(conn)
        hello = next(messages, None)
        if not isinstance(hello, dict) or hello.get("token") != self.token:
            conn.close()
            return
        node = hello.get("hello")
        if not isinstance(node, int):
            conn.close()
            return
        with self._lock:
            self._conns[node] = conn
            self._heard[node] = time.monotonic()
            reason = self._stop_reason
        self.events.put(Event("hello", node, hello))
        if reason is not None:
            _send(conn, {"stop": reason})  # it connected after the job was stopped
        finished = False
        for message in messages:
            self._heard[node] = time.monotonic()
            if "failed" in message:
                self.events.put(Event("failed", node, message["failed"]))
            elif "done" in message:
                finished = True
                self.events.put(Event("done", node, message))
        with self._lock:
            self._conns.pop(node, None)
        if not finished and not self._closed:
            self.events.put(Event("lost", node, {}))

    def _ping(self) -> None:
        while not self._closed:
            with self._lock:
                conns = dict(self._conns)
            now = time.monotonic()
            for node, conn in conns.items():
                if now - self._heard.get(node, now) > LOST_S:
                    _shut(conn)  # a silent node: _serve reports it lost
                else:
                    _send(conn, {"ping": 1})
            time.sleep(PING_S)

    def stop_all(self, reason: str) -> None:
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
            conns = list(self._conns.values())
        for conn in conns:
            _send(conn, {"stop": reason})

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()


class ControlClient:
    """A node launcher's side. `stop_reason` turns non-None when the node must stop."""

    def __init__(self, control: str, node_rank: int, host: str) -> None:
        addr, port, token = control.rsplit(":", 2)
        self.where = f"{addr}:{port}"
        self._sock = self._connect(addr, int(port))
        self._last_heard = time.monotonic()
        self._stop: str | None = None
        self._sent_end = False
        _send(self._sock, {"hello": node_rank, "token": token, "host": host})
        threading.Thread(target=self._listen, daemon=True).start()
        threading.Thread(target=self._ping, daemon=True).start()

    def _connect(self, addr: str, port: int) -> socket.socket:
        deadline = time.monotonic() + CONNECT_S
        while True:
            try:
                return socket.create_connection((addr, port), timeout=5)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot reach the deepspeed launcher at {addr}:{port}: {e}"
                    ) from None
                time.sleep(0.5)

    def _listen(self) -> None:
        self._sock.settimeout(None)
        for message in _lines(self._sock):
            self._last_heard = time.monotonic()
            if "stop" in message and self._stop is None:
                self._stop = str(message["stop"])
        if self._stop is None and not self._sent_end:
            self._stop = f"lost the deepspeed launcher at {self.where} (connection closed)"

    def _ping(self) -> None:
        while not self._sent_end and _send(self._sock, {"ping": 1}):
            time.sleep(PING_S)

    @property
    def stop_reason(self) -> str | None:
        if self._stop is None and time.monotonic() - self._last_heard > LOST_S:
            self._stop = f"no word from the deepspeed launcher at {self.where} for {LOST_S:.0f} s"
        return self._stop

    def failed(self, info: dict[str, Any]) -> None:
        _send(self._sock, {"failed": info})

    def done(self, code: int) -> None:
        self._sent_end = True
        _send(self._sock, {"done": code})

    def close(self) -> None:
        self._sent_end = True
        _shut(self._sock)
        self._sock.close()

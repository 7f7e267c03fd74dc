"""Inter-process build lock that a killed builder cannot leave behind.

[Note: build lock]
torch's own build lock is a file created with O_EXCL: a build killed halfway leaves it, and
every later load waits on it forever. Ours is an flock(2) on a file, which the kernel drops
when the holder dies however it dies, so a stale lock is impossible by construction; the
holder's pid is written into the file only so that waiters can say whom they wait for.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from types import TracebackType

from .errors import OpBuildError


def _timeout_s() -> float:
    return float(os.environ.get("DS_BUILD_LOCK_TIMEOUT", "1800"))


class BuildLock:
    def __init__(self, path: Path, op: str, poll_s: float = 0.2) -> None:
        self.path = path
        self.op = op
        self.poll_s = poll_s
        self.fd: int | None = None

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def __enter__(self) -> BuildLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + _timeout_s()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    print(
                        f"[deepspeed_ext] waiting for pid {self._holder()} to finish building "
                        f"op '{self.op}'",
                        file=sys.stderr,
                    )
                    announced = True
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise OpBuildError(
                        f"gave up waiting {_timeout_s():.0f} s for pid {self._holder()} to "
                        f"build op '{self.op}' (lock {self.path}). If that process is stuck, "
                        "kill it; raise DS_BUILD_LOCK_TIMEOUT to wait longer."
                    ) from None
                time.sleep(self.poll_s)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

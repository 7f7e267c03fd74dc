"""The launcher's dead-man switch: a small process that stops the ranks if the launcher dies.

Ranks run in sessions of their own (so teardown can signal whole process groups), which also
means nothing stops them when the launcher itself is SIGKILLed (the OOM killer, `kill -9`, a
scheduler's hard stop): they would run on, holding the port and the devices. So the launcher
starts this process first, in a session of its own, and tells it each rank's process group
through a pipe. The pipe's other end closes only when the launcher ends; if it ends without
saying "done" first, every group gets SIGTERM, then SIGKILL after the grace period.

Stdlib only, and run as `python -m deepspeed_ext.launcher.reaper GRACE`: it must start fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import IO

from .procs import live_groups, stop_groups

DONE = b"done\n"


class Reaper:
    """The launcher's end of the pipe. `watch(pgid)` for each rank started; `close()` once the
    launcher's own teardown has run (the reaper then exits without touching anything)."""

    def __init__(self, grace: float) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deepspeed_ext.launcher.reaper", str(grace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # stderr stays ours, for the one line it may write
            start_new_session=True,  # a signal to the launcher's group does not reach it
        )
        assert self._proc.stdin is not None
        self._pipe: IO[bytes] | None = self._proc.stdin

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the launcher failed before its own teardown ran: let the reaper stop the ranks
            self.abandon()

    def watch(self, pgid: int) -> None:
        self._send(f"{pgid}\n".encode())

    def close(self) -> None:
        """The launcher has stopped its ranks itself: the reaper exits doing nothing."""
        self._send(DONE)
        self.abandon()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def abandon(self) -> None:
        """Close our end without "done": the reaper stops every group it was told of (and
        is left to do so: it runs on after we return)."""
        if self._pipe is not None:
            try:
                self._pipe.close()
            except OSError:
                pass
            self._pipe = None

    def _send(self, line: bytes) -> None:
        if self._pipe is None:
            return
        try:
            self._pipe.write(line)
            self._pipe.flush()
        except OSError:
            # the reaper is gone (killed with our group): the launcher's own teardown still
            # runs, so this only loses the protection against the launcher being killed too
            self._pipe = None


def main(argv: list[str]) -> int:
    grace = float(argv[0]) if argv else 5.0
    # the launcher's Ctrl-C must not stop us half way through a teardown of our own
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    stdin = sys.stdin.buffer
    for line in iter(stdin.readline, b""):
        if line == DONE:
            return 0
        try:
            groups.add(int(line))
        except ValueError:
            continue  # not a line the launcher writes: ignore rather than die unwatched
    # the launcher ended without saying done: it was killed
    alive = live_groups(groups)
    if alive:
        os.write(
            2,
            f"deepspeed: the launcher ended without stopping its ranks; stopping "
            f"{len(alive)} rank process group(s)\n".encode(),
        )
        stop_groups(alive, grace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One rank process: started in its own session (so its whole process group, grandchildren
included, can be signalled at once), with its stderr teed to ours and the tail kept."""

from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO

TAIL_LINES = 20
# the file a rank writes the time it began to exit to (deepspeed_ext.comm, at exit)
EXIT_STAMP_ENV = "DS_EXT_EXIT_STAMP"
_HOLD_S = 0.2  # how long an unfinished stderr line may wait for its newline
_stderr_lock = threading.Lock()  # one writer at a time, so rank lines do not interleave


def _write_stderr(data: bytes) -> None:
    """Straight to fd 2: no Python buffering between a rank's line and the terminal."""
    with _stderr_lock:
        view = memoryview(data)
        while view:
            try:
                n = os.write(2, view)
            except OSError:
                return  # our stderr is gone (closed pipe): keep draining the rank anyway
            view = view[n:]


def live_groups(pgids: Iterable[int]) -> set[int]:
    """Which of these process groups still have a live (non-zombie) member.

    One pass over /proc answers for all groups; a zombie does not count, since an init
    that never reaps would otherwise keep a finished group "alive" forever.
    """
    wanted = set(pgids)
    try:
        names = os.listdir("/proc")
    except OSError:
        return {g for g in wanted if _killpg_probe(g)}  # no /proc (not Linux)
    alive: set[int] = set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # the fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != b"Z" and int(fields[2]) in wanted:
            alive.add(int(fields[2]))
    return alive


def signal_group(pgid: int, sig: int) -> None:
    """Signal a whole process group; one already gone is no error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(
    groups: Iterable[int],
    grace: float,
    hurry: Callable[[], bool] = bool,
    tick: Callable[[], object] = lambda: None,
) -> set[int]:
    """SIGTERM each group with a live member, SIGKILL what is left after `grace` seconds (or
    as soon as `hurry()`); `tick` runs between looks (the launcher reaps its rank leaders
    there, so they stop counting as members). Returns the groups still alive after all."""
    tick()
    alive = live_groups(groups)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        for pgid in alive:
            signal_group(pgid, sig)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline and not (sig == signal.SIGTERM and hurry()):
            time.sleep(0.05)
            tick()
            alive = live_groups(alive)
        if not alive:
            break
    return alive


def _killpg_probe(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class RankProcess:
    """A started rank. `prefix` marks its teed stderr lines (None: copied unchanged)."""

    def __init__(
        self,
        rank: int,
        local_rank: int,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log_path: str | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.cmd = list(cmd)
        self.env = dict(env)
        self.log_path = log_path
        self._prefix = prefix
        self._tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self._partial = b""  # the line being written, not yet ended by a newline
        self._thread: threading.Thread | None = None
        log: IO[bytes] | None = open(log_path, "wb") if log_path else None
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,  # None: the launcher's own stdout
                stderr=log if log else subprocess.PIPE,
                start_new_session=True,  # own session and group: killpg reaches grandchildren
            )
        finally:
            if log:
                log.close()  # the child holds its own copy
        self.pid = self.proc.pid  # also the process group id, after setsid
        self.ended_at: float | None = None  # wall-clock time the process ended
        threading.Thread(target=self._wait, daemon=True).start()
        if self.proc.stderr is not None:
            self._thread = threading.Thread(
                target=self._tee, args=(self.proc.stderr.fileno(),), daemon=True
            )
            self._thread.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()

    def began_exit(self) -> float | None:
        """[Note: who failed first] When the rank began to exit: the time its interpreter
        stamped at exit (EXIT_STAMP_ENV), else when the process ended (killed, or a script
        that never initialized deepspeed_ext.comm)."""
        path = self.env.get(EXIT_STAMP_ENV)
        if path:
            try:
                with open(path) as f:
                    return float(f.read().strip())
            except (OSError, ValueError):
                pass
        return self.ended_at

    def _tee(self, fd: int) -> None:
        pending = b""  # the unfinished line, held back so ranks' lines do not interleave
        shown = False  # part of the current line already went out (with its prefix)
        while True:
            if pending and not select.select([fd], [], [], _HOLD_S)[0]:
                self._show(pending, shown)  # a prompt or a slow line: show what there is
                pending, shown = b"", True
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._keep(chunk)
            if self._prefix is None:
                _write_stderr(chunk)  # a single rank: nothing to keep apart
                continue
            data = pending + chunk
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            if cut:
                self._show(data[:cut], shown)
                pending, shown = data[cut:], False
            else:
                pending = data
            if len(pending) > 65536:  # no newline in sight: do not hold it all
                self._show(pending, shown)
                pending, shown = b"", True
        if pending:
            self._show(pending, shown)
        if self._partial:
            self._tail.append(self._partial)
            self._partial = b""

    def _show(self, data: bytes, continued: bool) -> None:
        """Write whole lines, each marked with the prefix (not a continued first line)."""
        assert self._prefix is not None
        pieces = data.splitlines(keepends=True)
        marked = [p if i == 0 and continued else self._prefix + p for i, p in enumerate(pieces)]
        _write_stderr(b"".join(marked))

    def _keep(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-4096:]  # a progress bar without newlines stays bounded
        self._tail.extend(lines[-TAIL_LINES:])

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        signal_group(self.pid, sig)

    def finish_output(self, timeout: float = 2.0) -> None:
        """Wait for the tee to drain what the rank wrote before it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.proc.stderr is not None and (self._thread is None or not self._thread.is_alive()):
            self.proc.stderr.close()

    def stderr_tail(self, n: int = TAIL_LINES) -> list[str]:
        """The last `n` lines the rank wrote to stderr (from its log file when it has one)."""
        if self.log_path is not None:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(max(0, os.path.getsize(self.log_path) - 64 * 1024))
                    lines = f.read().splitlines()
            except OSError:
                return []
        else:
            lines = list(self._tail) + ([self._partial] if self._partial else [])
        return [line.decode(errors="replace").rstrip("\r") for line in lines[-n:]]

    def describe_exit(self) -> str:
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"was killed by {name}"
        return f"exited with code {rc}"


def exit_code(returncode: int) -> int:
    """A rank's status as a shell reports it: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode

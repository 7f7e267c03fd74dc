"""Spawn real ranks (separate processes, gloo) and collect what each returns.

fn must be importable (a module-level function); it runs as fn(*args) in each rank with the
env contract set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and its return
value comes back through a pickle file. A rank that raises fails the test with its traceback;
a run that outlives `timeout` is killed, all of it.

Ranks are forked from a fork server that has imported torch once (multiprocessing's
"forkserver", torch preloaded): each rank is still a fresh process, but does not pay torch's
import (about 2 s of CPU a rank, over the suite's ~400 ranks on 2 cores). The server was
started with the environment of the test that first spawned, so each rank takes the test's
environment as it is at the call (monkeypatched variables included) before anything reads it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

from deepspeed_ext.comm import free_port

# read once, at a process's start (the C library, the interpreter): a rank forked from the
# server would run with the server's, so a test that changes one gets freshly spawned ranks
_START_TIME_PREFIXES = ("MALLOC_", "LD_", "GLIBC_", "PYTHON")
_LEAVE_WAIT_S = 60.0  # how long rank 0 waits for the others to be done with its store


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: str,
    args: tuple,
    env: dict[str, str],
    stdout: int,
    stderr: int,
) -> None:
    for fd, target in ((stdout, 1), (stderr, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # 2 cores shared by all ranks
    try:
        result: Any = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - sent back to the test
        result = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    _leave_together(rank, world, result[0] == "ok")


def _leave_together(rank: int, world: int, ok: bool) -> None:
    """Rank 0 hosts the TCP store: had it exited while another rank still used the store
    (a side group's rendezvous after rank 0's last collective), that rank would fail with
    'Connection reset by peer'. Each rank counts itself done in the store, and a rank 0
    that succeeded stays until all have (bounded: a rank that hangs is the join's to kill).
    A function that destroyed its process group has no store left to count in."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        done = store.add("run_ranks/done", 1)
        deadline = time.monotonic() + _LEAVE_WAIT_S
        while rank == 0 and ok and done < world and time.monotonic() < deadline:
            time.sleep(0.005)
            done = store.add("run_ranks/done", 0)
    except Exception:  # noqa: BLE001 - a store already gone: nothing left to protect
        pass


class _TestFd:
    """One of the test process's fds, pickled as a duplicate for the rank being started
    (multiprocessing sends it along), unpickled as the rank's own fd number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _start_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_START_TIME_PREFIXES)}


_SERVER: tuple[Any, dict[str, str]] | None = None  # the forkserver context, its start env


def _context() -> Any:
    global _SERVER
    if _SERVER is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        _SERVER = (ctx, _start_time_env())
    ctx, start_env = _SERVER
    return ctx if _start_time_env() == start_env else mp.get_context("spawn")


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> list[Any]:
    ctx = _context()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as d:
        outs = [str(Path(d) / f"rank{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world, port, outs[r], args, env, _TestFd(1), _TestFd(2)),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} rank(s) still running after {timeout} s (hang?)")
        results = []
        for r, out in enumerate(outs):
            if not os.path.exists(out):
                raise RuntimeError(
                    f"rank {r} died without a result (exit code {procs[r].exitcode})"
                )
            with open(out, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results

"""Spawn real ranks (separate processes, gloo) and collect what each returns.

fn must be importable (a module-level function); it runs as fn(*args) in each rank with the
env contract set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and its return
value comes back through a pickle file. A rank that raises fails the test with its traceback;
a run that outlives `timeout` is killed, all of it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepspeed_ext.comm import free_port


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
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


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        outs = [str(Path(d) / f"rank{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, outs[r], args), daemon=True)
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

"""Upstream's stage-addressed point-to-point calls (`deepspeed.runtime.pipe.p2p`), for code
that moves its own tensors or objects between neighbouring pipeline stages (generation
loops, custom schedules). The engine itself uses PipeChannel ([Note: pipeline p2p]).

init_process_groups(engine.grid) first; then a stage sends to and receives from the stage
before or after it (the first and last stages also to each other, as upstream allows).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from deepspeed_ext.comm.sharded import collective_device
from deepspeed_ext.comm.torch_style import irecv, isend

_state: dict[str, Any] = {"grid": None, "pending": []}


def init_process_groups(grid: Any) -> None:
    """Remember the pipeline grid (a PipelineEngine's `grid`) that stage ids refer to."""
    _state["grid"] = grid


def can_send_recv() -> bool:
    """Point-to-point runs on every backend here (upstream falls back to broadcasts)."""
    return True


def _peer(stage: int) -> int:
    grid = _state["grid"]
    if grid is None:
        raise RuntimeError(
            "deepspeed.runtime.pipe.p2p: call init_process_groups(engine.grid) before send/recv"
        )
    me, n = grid.get_stage_id(), grid.get_pipe_parallel_world_size()
    if not 0 <= stage < n or abs(stage - me) not in (1, n - 1) or stage == me:
        raise ValueError(
            f"deepspeed.runtime.pipe.p2p: stage {me} cannot exchange with stage {stage} of "
            f"{n}: only neighbouring stages (and the first with the last) do"
        )
    return int(grid.stage_to_global(stage))


def _run(work: Any, async_op: bool) -> Any:
    if async_op:
        _state["pending"].append(work)
        return work
    work.wait()
    return None


def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
    return _run(isend(tensor, _peer(dest_stage)), async_op)


def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
    return _run(irecv(tensor, _peer(src_stage)), async_op)


def wait() -> None:
    """Wait for every send and receive started with async_op=True."""
    pending, _state["pending"] = _state["pending"], []
    for work in pending:
        work.wait()


def send_obj(msg: Any, dest: int) -> None:
    """A picklable object to stage `dest`: its length, then its bytes (on the collective
    device, which NCCL needs)."""
    dev = collective_device()
    data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8).to(dev)
    send(torch.tensor([data.numel()], dtype=torch.int64).to(dev), dest)
    send(data, dest)


def recv_obj(sender: int) -> Any:
    """The object stage `sender` sent with send_obj."""
    dev = collective_device()
    n = torch.empty(1, dtype=torch.int64, device=dev)
    recv(n, sender)
    data = torch.empty(int(n), dtype=torch.uint8, device=dev)
    recv(data, sender)
    return pickle.loads(data.cpu().numpy().tobytes())  # this job's own ranks sent it

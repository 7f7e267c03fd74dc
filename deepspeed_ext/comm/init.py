"""init_distributed: one call that brings up torch.distributed from whatever launched us."""

from __future__ import annotations

import atexit
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from deepspeed_ext.accelerator import get_accelerator, strict
from deepspeed_ext.utils.logging import logger

from . import exchange
from .env import DistEnv, discover

_env: DistEnv | None = None
# Callbacks that drop module-level references to process groups held above comm (a
# layer's cache), run at exit before the groups are destroyed ([Note: clean exit]).
_release_at_exit: list[Callable[[], None]] = []


def release_at_exit(fn: Callable[[], None]) -> None:
    """Call fn at exit before the process groups are destroyed, so a group it lets go of is
    freed then, not left to interpreter teardown."""
    _release_at_exit.append(fn)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Upstream's signature. Idempotent: a second call (or torch.distributed already up) is a
    no-op. The backend defaults to the accelerator's (gloo on CPU, nccl on CUDA)."""
    global _env
    strict.install()  # DS_EXT_DEVICE_STRICT=1: [Note: device-strict mode]
    if dist.is_initialized():
        if _env is None:
            _env = DistEnv(
                dist.get_rank(),
                dist.get_world_size(),
                _local_rank_guess(),
                "",
                0,
                "torch.distributed (initialized by the caller)",
            )
        return
    if dist_init_required is False:
        return
    env = discover(default_port=distributed_port, auto_mpi_discovery=auto_mpi_discovery)
    if rank >= 0 and world_size > 0:
        env = DistEnv(
            rank,
            world_size,
            env.local_rank,
            env.master_addr,
            env.master_port,
            "explicit rank/world_size",
        )
    env.export()
    backend = dist_backend or get_accelerator().communication_backend_name()
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.set_device(env.local_rank)
    if verbose:
        logger.info(
            f"initializing torch.distributed: backend={backend}, world_size={env.world_size} "
            f"(from {env.source}), master={env.master_addr}:{env.master_port}"
        )
    _bind_group_defaults_early()
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        timeout=timeout,
        rank=env.rank,
        world_size=env.world_size,
    )
    _env = env
    # A process group left to interpreter teardown can abort the rank ("terminate called
    # without an active exception": gloo's threads destroyed while joinable, seen after ZeRO
    # runs); the group we created is destroyed in order at exit instead.
    atexit.register(_destroy_at_exit)
    atexit.register(_stamp_exit)  # runs first (atexit is last in, first out)


def _stamp_exit() -> None:
    """Tell the launcher when this rank began to exit ([Note: who failed first])."""
    path = os.environ.get("DS_EXT_EXIT_STAMP")
    if path:
        try:
            with open(path, "w") as f:
                f.write(f"{time.time():.6f}")
        except OSError:
            pass


def _bind_group_defaults_early() -> None:
    """[Note: clean exit]
    torch.distributed.nn.functional evaluates `group=group.WORLD` as a default argument at
    import, so importing it after the process group exists pins that group from ten
    function defaults. Constructing any torch optimizer imports it (through torch._dynamo).
    The pinned group then survives destroy_process_group at exit, its gloo worker threads
    live on into interpreter finalization, and one of them dropping its last finished work
    (whose tensors need the GIL to release) is killed there: "terminate called without an
    active exception", SIGABRT, exit 134 after all the work was done (seen in about 1 of 12
    two-rank ZeRO-2 jobs; gdb: ProcessGroupGloo::runLoop -> ~AsyncWork -> take_gil ->
    pthread_exit in Py_FinalizeEx). Imported before the group exists, the defaults are None,
    destroy_process_group at exit frees the group and joins its threads while the
    interpreter is whole."""
    import torch.distributed.nn  # noqa: F401 - imported for its side effect on defaults


def _destroy_at_exit() -> None:
    # Drop the groups we keep at module level first, so destroying them frees them now.
    # Sub-groups a user object still holds (an engine's layout) live on until it is freed.
    from . import layout

    for release in _release_at_exit:
        release()
    layout.forget_groups()
    exchange.forget()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; never mask the real exit status
            pass
    # A sub-group a user object still holds (a tensor-sliced model's group) keeps its gloo
    # threads until interpreter teardown. Such a thread frees each finished work after the
    # caller's wait() returns, and freeing the work's Python-made tensors takes the GIL: when
    # the job's last collective (a 16-bit export's gathers) is followed at once by exit, the
    # thread still waits for the GIL when finalization starts, and exits mid-destructor:
    # SIGABRT (gdb: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> take_gil ->
    # pthread_exit; 2-rank AutoTP Trainer jobs, about 1 in 8). Sleeping here hands it the GIL
    # while the interpreter is whole.
    time.sleep(0.05)


def _local_rank_guess() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return _env.local_rank if _env is not None else _local_rank_guess()


def destroy_process_group(group: Any = None) -> None:
    global _env
    strict.install()  # DS_EXT_DEVICE_STRICT=1: [Note: device-strict mode]
    if dist.is_initialized():
        dist.destroy_process_group(group)
    exchange.forget()
    if group is None:
        _env = None

"""One node: start its ranks, watch them, and stop all of them when one fails or when we are
told to stop (Ctrl-C, SIGTERM, SIGHUP). Nothing is left behind: every rank runs in its own
process group, and teardown signals whole groups until none has a live member.

Also runnable as `python -m deepspeed_ext.launcher.launch --world_info=... script ...`, the
per-node entry a multi-node runner starts on each host.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from deepspeed_ext.utils import numa

from .control import ControlClient
from .devices import local_gpus
from .env import NodePlan, decode_world_info, rank_env
from .ports import DEFAULT_MASTER_PORT
from .procs import EXIT_STAMP_ENV, RankProcess, exit_code, stop_groups
from .reaper import Reaper

KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL: with the polling below all is gone within ~6 s
POLL_S = 0.1  # how quickly a failed rank is noticed
SETTLE_S = 2.0  # how long ranks already exiting get to end before the cause is named
STOPPED_BY_RUNNER = 143  # a node stopped because the job failed elsewhere (as by SIGTERM)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class ScriptSpec:
    """What every rank runs."""

    script: str
    args: list[str] = field(default_factory=list)
    module: bool = False  # python -m script
    no_python: bool = False  # run the script itself, no interpreter in front
    no_local_rank: bool = False  # do not append --local_rank=<n>
    bind_cores: bool = False  # each rank on its share of the cores ([Note: core binding])
    bind_core_list: str | None = None  # the cores to share out (None: all this process may use)

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise ValueError("--module and --no_python cannot be used together")

    def command(self, local_rank: int) -> list[str]:
        if self.no_python:
            cmd = [self.script]
        else:
            cmd = [sys.executable, "-u", *(["-m"] if self.module else []), self.script]
        if not self.no_local_rank:
            cmd.append(f"--local_rank={local_rank}")
        return cmd + list(self.args)


def bound_command(
    cmd: list[str], core_list: str | None, local_size: int, local_rank: int
) -> tuple[list[str], int]:
    """[Note: core binding] `cmd` confined to this rank's share of the cores, and the share's
    size (the rank's OMP_NUM_THREADS): through numactl where installed, which also binds
    memory to the cores' NUMA node; else through `deepspeed_ext.launcher.bind` (cores only)."""
    if numa.check_for_numactl_pkg():
        per_rank, prefix = numa.get_numactl_cmd(core_list, local_size, local_rank)
    else:
        per_rank, cores = numa.cores_for_rank(core_list, local_size, local_rank)
        bind = [sys.executable, "-m", "deepspeed_ext.launcher.bind"]
        prefix = [*bind, numa.format_cores(cores), "--"]
    return prefix + cmd, per_rank


def say(message: str) -> None:
    print(f"deepspeed: {message}", file=sys.stderr, flush=True)


class StopSignals:
    """Turns SIGINT/SIGTERM/SIGHUP into a flag the watch loop reads; one more while we are
    already stopping hurries the teardown (no grace before SIGKILL)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopping = False
        self.hurry = False
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None or self.stopping:
            self.hurry = True
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def teardown(
    ranks: Sequence[RankProcess], grace: float = KILL_GRACE_S, hurry: Callable[[], bool] = bool
) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace` seconds."""

    def reap_leaders() -> None:
        for r in ranks:
            r.poll()

    alive = stop_groups([r.pid for r in ranks], grace, hurry, reap_leaders)
    if alive:
        say(f"could not stop process groups {sorted(alive)}")


def _watch(
    ranks: Sequence[RankProcess], stopper: StopSignals, control: ControlClient | None
) -> RankProcess | None:
    """Until all ranks end, one fails (returned), a stop signal comes, or the job's runner
    says stop (or is lost)."""
    while stopper.signum is None and (control is None or control.stop_reason is None):
        running = False
        for r in ranks:
            rc = r.poll()
            if rc is None:
                running = True
            elif rc != 0:
                return r
        if not running:
            return None
        time.sleep(POLL_S)
    return None


def _first_to_fail(ranks: Sequence[RankProcess], noticed: RankProcess) -> RankProcess:
    """[Note: who failed first] The failed rank that began to exit first, which is the cause
    of the others' failures. A rank that calls sys.exit(5) while its peers wait in a
    collective spends longer in its exit (destroying its process group) than the peers take
    to raise "connection closed" and end with 1: by the end times alone the innocent peer
    looks first. So ranks already exiting are given SETTLE_S to end, then the earliest
    begun exit among the failed ones wins."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(
        r.poll() is None and r.began_exit() is not None for r in ranks
    ):
        time.sleep(0.02)
    failed = [r for r in ranks if r.poll() not in (None, 0)]
    return min(failed, key=lambda r: r.began_exit() or float("inf"), default=noticed)


def _report_failure(failed: RankProcess) -> None:
    tail = failed.stderr_tail()
    what = f"lines of {failed.log_path}" if failed.log_path else "stderr lines"
    if tail:
        say(f"last {len(tail)} {what} of rank {failed.rank}:")
        print("\n".join(f"    {line}" for line in tail), file=sys.stderr, flush=True)
    else:
        say(f"rank {failed.rank} wrote nothing to stderr")


def _log_paths(log_dir: str | None, plan: NodePlan) -> list[str | None]:
    """Per-rank log files, named as upstream: <YYYYmmddHHMMSS>_rank<N>.log."""
    if log_dir is None:
        return [None] * plan.local_size
    if os.path.isfile(log_dir):
        raise ValueError(f"--enable_each_rank_log {log_dir} is a file; it should be a directory")
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        msg = f"--enable_each_rank_log {log_dir}: cannot create it ({e.strerror})"
        raise ValueError(msg) from None
    stamp = time.strftime("%Y%m%d%H%M%S")
    return [
        os.path.join(log_dir, f"{stamp}_rank{plan.global_rank(i)}.log")
        for i in range(plan.local_size)
    ]


def launch_node(
    plan: NodePlan,
    spec: ScriptSpec,
    base_env: Mapping[str, str] | None = None,
    log_dir: str | None = None,
    grace: float = KILL_GRACE_S,
    control: ControlClient | None = None,
) -> int:
    """Run this node's ranks to the end; the exit code the launcher should return.

    With `control` (a multi-node job), a failed rank is reported to the runner at once (it
    stops the other hosts and prints the stderr tail), and the runner's `stop` stops ours.
    """
    base = dict(os.environ if base_env is None else base_env)
    logs = _log_paths(log_dir, plan)
    many = plan.world_size > 1  # one rank: its stderr passes through unmarked
    ranks: list[RankProcess] = []
    stamp_dir = tempfile.TemporaryDirectory(prefix="deepspeed_exit_")
    with stamp_dir as stamps, StopSignals() as stopper, Reaper(grace) as reaper:
        try:
            for local_rank in range(plan.local_size):
                rank = plan.global_rank(local_rank)
                cmd, env = spec.command(local_rank), rank_env(base, plan, local_rank)
                env[EXIT_STAMP_ENV] = os.path.join(stamps, f"rank{rank}.exit")
                if spec.bind_cores:
                    cmd, threads = bound_command(
                        cmd, spec.bind_core_list, plan.local_size, local_rank
                    )
                    if "OMP_NUM_THREADS" not in base:
                        env["OMP_NUM_THREADS"] = str(threads)
                ranks.append(
                    RankProcess(
                        rank,
                        local_rank,
                        cmd,
                        env,
                        log_path=logs[local_rank],
                        prefix=f"[rank {rank}] ".encode() if many else None,
                    )
                )
                reaper.watch(ranks[-1].pid)
                if stopper.signum is not None:
                    break
        except OSError as e:
            say(f"cannot start rank {plan.global_rank(len(ranks))}: {e}")
            teardown(ranks, grace, lambda: stopper.hurry)
            return 127 if isinstance(e, FileNotFoundError) else 126

        failed = _watch(ranks, stopper, control)
        if failed is not None:
            failed = _first_to_fail(ranks, failed)
        external = None if control is None else control.stop_reason
        if failed is not None:
            others = sum(1 for r in ranks if r is not failed and r.poll() is None)
            if control is not None:  # first, so the other hosts stop while we do
                control.failed(_failure_info(failed, plan))
            say(
                f"rank {failed.rank} (pid {failed.pid}) {failed.describe_exit()}; "
                f"stopping the other {others} rank(s)"
                + ("" if control is None else f" on {plan.hosts[plan.node_rank]}")
            )
        elif external is not None:
            say(f"stopping {len(ranks)} rank(s) on {plan.hosts[plan.node_rank]}: {external}")
        elif stopper.signum is not None:
            name = signal.Signals(stopper.signum).name
            say(f"received {name}; stopping {len(ranks)} rank(s)")
        # also after success: whatever a rank left running in its group goes too
        stopper.stopping = True
        teardown(ranks, grace, lambda: stopper.hurry)
        for r in ranks:
            r.finish_output()

    if failed is not None:
        if control is None:  # else the runner prints it, with the host
            _report_failure(failed)
        assert failed.proc.returncode is not None
        return exit_code(failed.proc.returncode)
    if stopper.signum is not None:
        return 128 + stopper.signum
    if external is not None:
        return STOPPED_BY_RUNNER
    return 0


def _failure_info(failed: RankProcess, plan: NodePlan) -> dict[str, object]:
    assert failed.proc.returncode is not None
    return {
        "rank": failed.rank,
        "host": plan.hosts[plan.node_rank],
        "pid": failed.pid,
        "code": exit_code(failed.proc.returncode),
        "ended_at": failed.began_exit() or time.time(),
        "exit": failed.describe_exit(),
        "tail": failed.stderr_tail(),
        "log": failed.log_path,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deepspeed_ext.launcher.launch",
        description="Start this node's share of a DeepSpeed job (one process per slot).",
    )
    p.add_argument("--node_rank", type=int, default=0, help="this node's index in world_info")
    p.add_argument("--node_host", default="", help="this node's name in world_info (wins)")
    p.add_argument("--control", default="", help="the runner's control address (multi-node)")
    p.add_argument("--master_addr", default="127.0.0.1", help="address of rank 0's node")
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--world_info", required=True, help="base64 JSON host -> slot ids")
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="run the script directly")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument("--enable_each_rank_log", default="None", help="folder for per-rank logs")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="bind each rank's cores")
    p.add_argument("--bind_core_list", default=None, help="the cores to share out")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def node_rank_of(world_info: Mapping[str, Sequence[int]], node_rank: int, node_host: str) -> int:
    """This node's index: by its name when given (pdsh's %h), else --node_rank."""
    hosts = list(world_info)
    if node_host:
        if node_host not in hosts:
            raise ValueError(f"--node_host {node_host} is not in the job's hosts {hosts}")
        return hosts.index(node_host)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node_rank {node_rank} is outside 0..{len(hosts) - 1}")
    return node_rank


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world_info = decode_world_info(args.world_info)
    try:
        node_rank = node_rank_of(world_info, args.node_rank, args.node_host)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    host = list(world_info)[node_rank]
    # GPU nodes: the slot ids are device ids (as upstream); CPU nodes: ranks only
    devices = [str(s) for s in world_info[host]] if local_gpus() else None
    plan = NodePlan(world_info, node_rank, args.master_addr, args.master_port, devices)
    spec = ScriptSpec(
        args.training_script,
        list(args.training_script_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        bind_cores=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
    )
    log_dir = None if args.enable_each_rank_log == "None" else args.enable_each_rank_log
    control = None
    if args.control:
        try:
            control = ControlClient(args.control, node_rank, host)
        except ConnectionError as e:
            say(f"error on {host}: {e}; no rank was started")
            return 1
    try:
        code = launch_node(plan, spec, log_dir=log_dir, control=control)
    except ValueError as e:  # a bad --enable_each_rank_log folder
        say(f"error on {host}: {e}")
        code = 2
    if control is not None:
        control.done(code)
        control.close()
    return code


if __name__ == "__main__":
    sys.exit(main())

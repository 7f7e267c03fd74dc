"""The `deepspeed` command: decide the resources, check the DeepSpeed config against the world
size before anything starts, then run this node's ranks (launch.py).

A hostfile naming several hosts (or --force_multi) makes a multi-node job: multinode.py
starts it through --launcher (pdsh by default) and stops it on every host as one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .devices import local_gpus
from .env import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    NodePlan,
    encode_world_info,
    read_deepspeed_env,
)
from .hostfile import (
    HostfileError,
    fetch_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)
from .launch import ScriptSpec, bound_command, launch_node, say
from .multinode import MultiNodeError, run_multinode
from .multinode_runner import RUNNERS
from .ports import DEFAULT_MASTER_PORT, check_port, choose_master_port

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "LauncherError",
    "Resources",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
    "resolve_resources",
]

DLTS_HOSTFILE = "/job/hostfile"  # upstream's default hostfile path
PID_FILE_DIR = "/tmp"  # --save_pid writes <dir>/<launcher pid>.deepspeed, as upstream
_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")

# Upstream flags this launcher parses (so existing command lines still parse) but does not do.
_UNSUPPORTED = {
    "autotuning": "--autotuning",
    "elastic_training": "--elastic_training",
}


class LauncherError(Exception):
    """A launch that cannot go ahead; the message says why (printed, exit code 1)."""


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deepspeed",
        description="Launch a DeepSpeed job: one process per GPU (or CPU rank) on this node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # else a script's `--b=1` is taken for our --bind_core_list
    )
    p.add_argument(
        "-H", "--hostfile", default=DLTS_HOSTFILE, help="MPI-style hostfile (`host slots=N`)"
    )
    spec_help = "NODE_SPEC[@NODE_SPEC...], NODE_SPEC=NAME[:SLOT[,SLOT...]], e.g. worker-0:0,1"
    p.add_argument("-i", "--include", default="", help=f"resources to use: {spec_help}")
    p.add_argument("-e", "--exclude", default="", help=f"resources to leave out: {spec_help}")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=-1,
        help="ranks per node (default: every visible GPU; 1 CPU rank where there is no GPU)",
    )
    p.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument(
        "--master_addr",
        default="",
        help="rank 0's address (default: 127.0.0.1 on one node; on several, the first host's "
        "first `hostname -I` address)",
    )
    p.add_argument(
        "--node_rank", type=int, default=-1, help="with --no_ssh: this node's index in the hosts"
    )
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="run the script without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument(
        "--enable_each_rank_log", default="None", help="write each rank's output to this folder"
    )
    p.add_argument("--save_pid", action="store_true", help="write /tmp/<pid>.deepspeed")
    p.add_argument("--validate", metavar="CONFIG", help="only validate this DeepSpeed config")
    p.add_argument("--world_size", type=int, help="the world size --validate checks against")
    p.add_argument(
        "--launcher",
        default="pdsh",
        type=str.lower,
        choices=sorted(RUNNERS),
        help="how a multi-node job starts its ranks",
    )
    p.add_argument(
        "--launcher_args", default="", help="arguments for the launcher (pdsh, mpirun or srun)"
    )
    p.add_argument("--no_ssh_check", action="store_true", help="do not check the hosts first")
    p.add_argument(
        "--no_ssh",
        action="store_true",
        help="start only this node's ranks (run the same command on each host with --node_rank)",
    )
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port of the hosts (pdsh)")
    p.add_argument("--venv_script", default=None, help="a script each host sources first (pdsh)")
    p.add_argument("--force_multi", action="store_true", help="multi-node launch even on one host")
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--elastic_training", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--autotuning", default="", choices=["", "tune", "run"], help=argparse.SUPPRESS)
    p.add_argument(
        "--bind_cores_to_rank",
        action="store_true",
        help="give each rank an equal share of the cores (and their NUMA memory, with numactl); "
        "OMP_NUM_THREADS = the share",
    )
    p.add_argument(
        "--bind_core_list",
        default=None,
        help="the cores --bind_cores_to_rank shares out, e.g. 0-15,32-47 (default: all)",
    )
    p.add_argument("user_script", nargs="?", help="the training script, then its arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p.parse_args(args)


@dataclass(frozen=True)
class Resources:
    active: dict[str, list[int]]  # host -> slot ids, in rank order
    devices: list[str] | None  # CUDA_VISIBLE_DEVICES entries of the first host; None: CPU
    source: str  # what set the world size, for config error messages

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.active.values())


def resolve_resources(
    args: argparse.Namespace, pool: Mapping[str, int] | None, gpus: Sequence[str]
) -> Resources:
    """The slots to run on, from the hostfile pool (or this node), the filters and counts.

    Without a hostfile, this node's slot ids are its visible GPU ids (so CUDA_VISIBLE_DEVICES
    is respected and --include localhost:1 means GPU 1), or 0..N-1 CPU ranks.
    """
    for flag, value in (("--num_gpus", args.num_gpus), ("--num_nodes", args.num_nodes)):
        if value == 0 or value < -1:  # -1: not given
            raise LauncherError(f"{flag} {value}: give 1 or more, or leave it out for all")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise LauncherError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    where = "on the deepspeed launcher"
    slot_device: dict[int, str] = {}
    if pool is None:
        if args.num_nodes > 1:
            raise LauncherError(
                f"--num_nodes {args.num_nodes} needs a hostfile listing that many hosts "
                f"(none at {args.hostfile})"
            )
        if gpus:
            ids = (
                [int(g) for g in gpus] if all(g.isdigit() for g in gpus) else list(range(len(gpus)))
            )
            slot_device = dict(zip(ids, gpus))
            hosts = {"localhost": list(slot_device)}
            source = f"{len(gpus)} visible GPU(s) {where}"
        else:
            n = args.num_gpus if args.num_gpus > 0 else 1
            hosts = {"localhost": list(range(n))}
            source = f"--num_gpus {n} {where}" if args.num_gpus > 0 else f"1 CPU rank {where}"
    else:
        hosts = {h: list(range(n)) for h, n in pool.items()}
        source = f"the hostfile {args.hostfile} {where}"

    try:
        active = parse_resource_filter(hosts, args.include, args.exclude)
    except HostfileError as e:
        raise LauncherError(str(e)) from None
    if args.include or args.exclude:
        flag = "--include" if args.include else "--exclude"
        source = f"{flag} {args.include or args.exclude} {where}"
    if args.num_nodes > 0:
        active = dict(list(active.items())[: args.num_nodes])
    if args.num_gpus > 0:
        n = args.num_gpus
        for host, slots in active.items():
            if slot_device and n > len(slots):
                raise LauncherError(f"--num_gpus {n} but only {len(slots)} GPU(s) are visible")
            # CPU ranks and hostfile hosts: slots 0..n-1, as upstream
            active[host] = slots[:n] if slot_device else list(range(n))
        source = f"--num_gpus {n} {where}"
    if not active:
        raise LauncherError("no slots left to run on after --include/--exclude")

    first = next(iter(active.values()))
    if not gpus:
        devices = None
    elif slot_device:
        devices = [slot_device[s] for s in first]
    else:
        devices = [str(s) for s in first]  # hostfile slots are device ids, as upstream
    return Resources(active, devices, source)


def config_argument(user_args: Sequence[str]) -> tuple[str, str] | None:
    """(flag, path) of the DeepSpeed config in the script's arguments, if any.

    `--deepspeed_config X` always names a config; `--deepspeed X` only when X is a .json
    (upstream's --deepspeed is a bare switch; HF Trainer's takes the path).
    """
    for i, arg in enumerate(user_args):
        for flag in _CONFIG_FLAGS:
            if arg == flag and i + 1 < len(user_args):
                value = user_args[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            if flag == "--deepspeed_config" or value.endswith(".json"):
                return flag, value
    return None


def check_config(path: str, world_size: int, source: str, allow_auto: bool = False) -> None:
    """Validate the job's config before any rank starts; LauncherError when it is wrong."""
    try:
        from deepspeed_ext.config import ConfigError, validate_config_file
    except ModuleNotFoundError as e:
        if e.name != "deepspeed_ext.config":
            raise
        return  # no config package in this install: the ranks will validate it
    try:
        validate_config_file(path, world_size, source, allow_auto=allow_auto)
    except ConfigError as e:
        raise LauncherError(f"{e}\nno rank was started") from None
    except OSError as e:
        raise LauncherError(f"cannot read the DeepSpeed config {path}: {e}") from None


def validate_only(config: str, world_size: int | None) -> int:
    """`deepspeed --validate cfg.json --world_size N`: check, print, exit; no torch, no ranks."""
    from deepspeed_ext.config import validate_cli

    sizes = [] if world_size is None else ["--world_size", str(world_size)]
    return int(validate_cli([config, *sizes]))


def _run(args: argparse.Namespace) -> int:
    for attr, flag in _UNSUPPORTED.items():
        if getattr(args, attr):
            raise LauncherError(f"{flag} is not supported by this launcher")
    if args.bind_core_list is not None and not args.bind_cores_to_rank:
        raise LauncherError("--bind_core_list only goes with --bind_cores_to_rank")
    try:
        spec = ScriptSpec(
            args.user_script,
            list(args.user_args),
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
            bind_cores=args.bind_cores_to_rank,
            bind_core_list=args.bind_core_list,
        )
        pool = fetch_hostfile(args.hostfile)
        extra_env = read_deepspeed_env()
    except (ValueError, OSError) as e:  # HostfileError and EnvFileError are ValueErrors
        raise LauncherError(str(e)) from None
    if pool is None and args.hostfile != DLTS_HOSTFILE:
        say(f"hostfile {args.hostfile} not found; running on this node only")

    res = resolve_resources(args, pool, local_gpus())
    found = config_argument(spec.args)
    if found is not None:
        flag, path = found
        # HF Trainer's --deepspeed fills "auto" values in the rank; DeepSpeed's own flag does not
        check_config(path, res.world_size, res.source, allow_auto=flag == "--deepspeed")
    multi = len(res.active) > 1 or args.force_multi
    if args.no_ssh:
        if not 0 <= args.node_rank < len(res.active):
            raise LauncherError(
                f"--no_ssh needs --node_rank between 0 and {len(res.active) - 1} "
                f"(this node's index among the hosts {list(res.active)})"
            )
    elif args.node_rank != -1:
        raise LauncherError("--node_rank only goes with --no_ssh")
    elif multi:
        pid_file = _write_pid_file(args.save_pid)
        try:
            return run_multinode(args, res.active, pool, extra_env)
        except MultiNodeError as e:
            raise LauncherError(str(e)) from None
        finally:
            _remove(pid_file)

    node_rank = max(args.node_rank, 0)
    try:  # the no_ssh path below passes it on unchecked
        check_port(args.master_port)
    except ValueError as e:
        raise LauncherError(str(e)) from None
    if args.no_ssh and len(res.active) > 1:  # every node must agree on rank 0's port
        master_addr, master_port = args.master_addr or next(iter(res.active)), args.master_port
    else:
        master_addr = args.master_addr or "127.0.0.1"
        master_port, note = choose_master_port(args.master_port)
        if note:
            say(note)
    devices = res.devices
    if devices is not None and node_rank > 0:  # hostfile slots are this node's device ids
        devices = [str(s) for s in list(res.active.values())[node_rank]]
    plan = NodePlan(res.active, node_rank, master_addr, master_port, devices)
    if spec.bind_cores:
        try:  # before any rank starts: enough cores for every rank, a readable list
            bound_command([], spec.bind_core_list, plan.local_size, 0)
        except ValueError as e:
            raise LauncherError(f"--bind_cores_to_rank: {e}") from None
        _check_usable_cores(spec.bind_core_list)
    on = f"GPU(s) {','.join(res.devices)}" if res.devices is not None else "CPU"
    host = plan.hosts[node_rank]
    say(
        f"{plan.local_size} of {plan.world_size} rank(s) on {host} ({on}), "
        f"master {master_addr}:{master_port}"
    )

    log_dir = None if args.enable_each_rank_log == "None" else args.enable_each_rank_log
    pid_file = _write_pid_file(args.save_pid)
    try:
        return launch_node(plan, spec, {**os.environ, **extra_env}, log_dir=log_dir)
    except ValueError as e:  # a bad --enable_each_rank_log folder
        raise LauncherError(str(e)) from None
    finally:
        _remove(pid_file)


def _check_usable_cores(core_list: str | None) -> None:
    """This node's ranks bind to cores this process may use, or sched_setaffinity fails in
    each rank after it started."""
    from deepspeed_ext.utils import numa

    if not core_list:
        return
    usable = numa.available_cores()
    bad = sorted(set(numa.parse_range_list(core_list)) - set(usable))
    if bad:
        raise LauncherError(
            f"--bind_core_list {core_list}: core(s) {numa.format_cores(bad)} are not among the "
            f"cores this process may use ({numa.format_cores(usable)})"
        )


def _write_pid_file(save_pid: bool) -> str | None:
    """--save_pid: /tmp/<launcher pid>.deepspeed holding that pid, as upstream."""
    if not save_pid:
        return None
    path = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepspeed")
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return path


def _remove(path: str | None) -> None:
    if path and os.path.exists(path):
        os.remove(path)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.validate is not None:
        return validate_only(args.validate, args.world_size)
    if args.world_size is not None:
        say("error: --world_size only goes with --validate")
        return 2
    if args.user_script is None:
        say("error: no training script given (usage: deepspeed [options] script [args...])")
        return 2
    try:
        return _run(args)
    except LauncherError as e:
        say(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

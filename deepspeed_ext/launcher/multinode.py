"""A job over several hosts: check every host answers before anything starts, pick rank 0's
address, start the backend's command, and see the job to one end.

With pdsh the runner supervises through the control channel ([Note: job control channel]):
the first failed rank (or lost host) stops every host, and its host, rank, exit and stderr
tail are printed here; its exit code is the job's. MPI launchers and srun stop their own
ranks; their exit code is the job's.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .control import ControlServer, Event
from .env import encode_world_info
from .launch import KILL_GRACE_S, POLL_S, StopSignals, say
from .multinode_runner import RUNNERS, MPIFamilyRunner, MultiNodeRunner, PDSHRunner
from .procs import signal_group

# Variables whose names start with these go to every rank (upstream's list, plus NCCL and
# gloo's, and ours: DS_ACCELERATOR, DS_EXT_*).
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO", "DS_"]
SSH_CHECK_TIMEOUT_S = 10
NODE_START_S = 60.0  # a host whose launcher has not called in by then is reported
STOP_WAIT_S = KILL_GRACE_S + 5.0  # hosts tear down within this once told to stop


class MultiNodeError(Exception):
    """The job cannot start (the message names the host or argument and the fix)."""


def make_runner(
    args: argparse.Namespace, active: Mapping[str, list[int]], pool: Mapping[str, int] | None
) -> MultiNodeRunner:
    name = args.launcher.lower()
    if name not in RUNNERS:
        raise MultiNodeError(
            f"--launcher {args.launcher} is unknown; choose one of {list(RUNNERS)}"
        )
    cls = RUNNERS[name]
    world_info = encode_world_info(active)
    try:
        if issubclass(cls, MPIFamilyRunner):
            runner: MultiNodeRunner = cls(
                args, world_info, pool or {h: len(s) for h, s in active.items()}
            )
        else:
            runner = cls(args, world_info)
    except ValueError as e:
        raise MultiNodeError(f"--launcher {name}: {e}") from None
    if not runner.backend_exists():
        raise MultiNodeError(
            f"--launcher {name} needs `{runner.tool}`, which is not on PATH: {runner.install_hint}"
        )
    return runner


def add_exports(
    runner: MultiNodeRunner, env: MutableMapping[str, str], deepspeed_env: Mapping[str, str]
) -> None:
    """As upstream: the job's folder first on PYTHONPATH, then the variables every rank needs."""
    cwd = os.path.abspath(".")
    env["PYTHONPATH"] = f"{cwd}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else cwd
    for key, value in env.items():
        if key.startswith(tuple(EXPORT_ENVS)):
            runner.add_export(key, value)
    for key, value in deepspeed_env.items():
        runner.add_export(key, value)


def ssh_options(env: Mapping[str, str], port: int | None) -> list[str]:
    """The options pdsh will give ssh (the user's PDSH_SSH_ARGS_APPEND, then -p)."""
    opts = shlex.split(env.get("PDSH_SSH_ARGS_APPEND", ""))
    return opts + (["-p", str(port)] if port is not None else [])


def check_hosts(hosts: Sequence[str], options: Sequence[str]) -> dict[str, list[str]]:
    """Each host's addresses (`hostname -I`) over ssh, all hosts at once; MultiNodeError
    naming every host that did not answer, before anything is started."""

    def probe(host: str) -> tuple[str, int, str, str]:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_TIMEOUT_S}"]
        cmd += [*options, host, "hostname -I"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=SSH_CHECK_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            return host, 124, "", f"no answer within {SSH_CHECK_TIMEOUT_S + 5} s"
        return host, r.returncode, r.stdout, r.stderr

    if shutil.which("ssh") is None:
        raise MultiNodeError(
            "ssh is not on PATH (apt-get install openssh-client), or pass --no_ssh_check"
        )
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(probe, hosts))
    bad = [
        (h, err.strip().splitlines()[-1:] or [f"ssh exited {rc}"])
        for h, rc, _, err in results
        if rc
    ]
    if bad:
        lines = "\n".join(f"    {h}: {msg[0]}" for h, msg in bad)
        raise MultiNodeError(
            f"{len(bad)} of {len(hosts)} host(s) cannot be reached by ssh, so nothing was "
            f"started:\n{lines}\nset up passwordless ssh to every host (options go in "
            f"PDSH_SSH_ARGS_APPEND, the port in --ssh_port), or leave the host out with --exclude"
        )
    return {h: out.split() for h, _, out, _ in results}


class _Job:
    """What the runner knows of a pdsh job, from the control events."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.started: set[int] = set()
        self.ended: dict[int, int] = {}
        self.failure: dict[str, Any] | None = None
        self.reason: str | None = None  # why the job was stopped (None: it was not)

    def on(self, ev: Event) -> None:
        host = self.hosts[ev.node] if 0 <= ev.node < len(self.hosts) else f"node {ev.node}"
        if ev.kind == "hello":
            self.started.add(ev.node)
        elif ev.kind == "failed" and (
            self.failure is None or ev.data["ended_at"] < self.failure.get("ended_at", 0)
        ):
            self.failure = ev.data  # the first rank to end is the cause; later ones followed it
        elif ev.kind == "done":
            code = int(ev.data.get("done", 1))
            self.ended[ev.node] = code
            if code and self.failure is None and self.reason is None:
                self.failure = {"host": host, "code": code, "what": f"its launcher exited {code}"}
        elif ev.kind == "lost" and ev.node not in self.ended and self.failure is None:
            self.failure = {
                "host": host,
                "code": 1,
                "what": "its launcher was lost (killed, or the network to it failed)",
            }

    def report(self) -> int:
        """Print why the job failed; its exit code."""
        f = self.failure
        assert f is not None
        if "rank" in f:
            say(f"rank {f['rank']} on host {f['host']} (pid {f['pid']}) {f['exit']}")
            tail = f.get("tail") or []
            what = f"lines of {f['log']}" if f.get("log") else "stderr lines"
            if tail:
                say(f"last {len(tail)} {what} of rank {f['rank']} on {f['host']}:")
                print("\n".join(f"    {line}" for line in tail), file=sys.stderr, flush=True)
        else:
            say(f"host {f['host']}: {f['what']}")
        return int(f["code"]) or 1


def supervise(
    proc: subprocess.Popen[Any],
    server: ControlServer,
    hosts: Sequence[str],
    kill_cmd: list[str],
    env: Mapping[str, str],
) -> int:
    """See a pdsh job to its end; the job's exit code."""
    job = _Job(hosts)
    start = time.monotonic()
    stop_by: float | None = None

    def stop(reason: str) -> None:
        nonlocal stop_by
        if job.reason is None:
            job.reason = reason
            server.stop_all(reason)
            stop_by = time.monotonic() + STOP_WAIT_S

    with StopSignals() as stopper:
        while proc.poll() is None:
            try:
                job.on(server.events.get(timeout=POLL_S))
            except queue.Empty:
                pass
            if job.failure is not None and job.reason is None:
                f = job.failure
                where = f"rank {f['rank']} on {f['host']}" if "rank" in f else f"host {f['host']}"
                others = len(hosts) - 1
                say(f"{where} failed; stopping the job on the other {others} host(s)")
                stop(f"{where} failed")
            if stopper.signum is not None and job.reason is None:
                name = signal.Signals(stopper.signum).name
                say(f"received {name}; stopping the job on {len(hosts)} host(s)")
                stop(f"the deepspeed launcher received {name}")
            missing = [hosts[i] for i in range(len(hosts)) if i not in job.started]
            if missing and job.reason is None and time.monotonic() - start > NODE_START_S:
                say(f"host(s) {', '.join(missing)} did not start within {NODE_START_S:.0f} s")
                job.failure = {"host": missing[0], "code": 1, "what": "did not start"}
                stop(f"host(s) {', '.join(missing)} did not start")
            if stop_by is not None and (time.monotonic() > stop_by or stopper.hurry):
                say("hosts did not stop in time; killing pdsh and the node launchers")
                signal_group(proc.pid, signal.SIGKILL)
                if kill_cmd:
                    subprocess.run(kill_cmd, env=dict(env), capture_output=True, timeout=30)
                break
        rc = proc.wait()
        while True:  # the last words of the hosts (a failure reported just before the end)
            try:
                job.on(server.events.get_nowait())
            except queue.Empty:
                break
    if job.failure is not None:
        return job.report()
    if stopper.signum is not None:
        return 128 + stopper.signum
    missing = [hosts[i] for i in range(len(hosts)) if i not in job.ended]
    if missing:
        say(f"pdsh exited {rc} before host(s) {', '.join(missing)} finished (see pdsh's output)")
        return rc or 1
    return rc


def run_backend(proc_cmd: list[str], env: Mapping[str, str]) -> int:
    """An MPI launcher or srun: it stops its ranks itself; we pass on our stop signals."""
    proc = subprocess.Popen(proc_cmd, env=dict(env), start_new_session=True)
    with StopSignals() as stopper:
        forwarded = 0
        while proc.poll() is None:
            time.sleep(POLL_S)
            if stopper.signum is not None and forwarded == 0:
                signal_group(proc.pid, signal.SIGINT)  # mpirun and srun stop their ranks on it
                forwarded = 1
                deadline = time.monotonic() + STOP_WAIT_S
            if forwarded and (time.monotonic() > deadline or stopper.hurry):
                signal_group(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    if stopper.signum is not None:
        return 128 + stopper.signum
    return 128 - rc if rc < 0 else rc


def run_multinode(
    args: argparse.Namespace,
    active: Mapping[str, list[int]],
    pool: Mapping[str, int] | None,
    deepspeed_env: Mapping[str, str],
) -> int:
    """Start the job on every host of `active` through --launcher; its exit code."""
    runner = make_runner(args, active, pool)
    env = dict(os.environ)
    hosts = list(active)
    if isinstance(runner, PDSHRunner) and not args.no_ssh_check:
        addresses = check_hosts(hosts, ssh_options(env, args.ssh_port))
        if not args.master_addr:  # as upstream: the first host's first `hostname -I` address
            first = addresses.get(hosts[0]) or [hosts[0]]
            args.master_addr = first[0]
    if not args.master_addr:
        args.master_addr = hosts[0]
    add_exports(runner, env, deepspeed_env)
    shape = ", ".join(f"{h}: {len(s)}" for h, s in active.items())
    world = sum(len(s) for s in active.values())
    say(
        f"{world} rank(s) on {len(hosts)} host(s) ({shape}) through {runner.name}, "
        f"master {args.master_addr}:{args.master_port}"
    )
    if not isinstance(runner, PDSHRunner):
        try:
            cmd = runner.get_cmd(env, active)
        except ValueError as e:
            raise MultiNodeError(f"--launcher {runner.name}: {e}") from None
        return run_backend(cmd, env)

    server = ControlServer(hosts)
    try:
        runner.control = server.address()
        cmd = runner.get_cmd(env, active)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        return supervise(proc, server, hosts, runner.kill_cmd(active), env)
    finally:
        server.close()

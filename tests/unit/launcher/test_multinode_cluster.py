"""The `deepspeed` launcher across a real cluster of 2 hosts on this machine: network
namespaces on a bridge, each with its own sshd (tests/helpers/netcluster.py), started over
pdsh/ssh from a hostfile. One cluster serves the module; every test checks that no process
is left in any namespace."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import netcluster
from tests.helpers.subproc import env_with

ROOT = Path(__file__).resolve().parents[3]
WHY_NOT = netcluster.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"test cluster: {WHY_NOT}")

RANK = """
import os, socket, sys, time
import torch, torch.distributed as dist
import deepspeed_ext.comm as comm

comm.init_distributed()
rank = dist.get_rank()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # which host am I on
    s.connect((os.environ["MASTER_ADDR"], 9))
    me = s.getsockname()[0]
print(f"<rank {rank}/{dist.get_world_size()} on {me} local {os.environ['LOCAL_RANK']} "
      f"sum {t.item():g} args {sys.argv[1:]}>", flush=True)
fail = os.environ.get("FAIL_RANK")
if fail is not None and rank == int(fail):
    print(f"rank {rank} fails on purpose at {time.time():.3f}", file=sys.stderr, flush=True)
    if os.environ.get("FAIL_HOW") == "kill":
        os.kill(os.getpid(), 9)
    sys.exit(7)
if os.environ.get("HANG"):
    open(os.environ["HANG"] + f".{rank}", "w").close()
    time.sleep(600)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[netcluster.Cluster]:
    tag = uuid.uuid4().hex[:4]
    c = netcluster.start(tag, 2, tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        netcluster.stop(c)


@pytest.fixture
def job(tmp_path: Path, cluster: netcluster.Cluster) -> Path:
    """A job folder: the rank script, a hostfile of both hosts (2 slots each), and the
    `.deepspeed_env` that tells gloo which interface the hosts talk on."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "hostfile").write_text("".join(f"{h} slots=2\n" for h in cluster.hosts))
    (tmp_path / ".deepspeed_env").write_text(f"GLOO_SOCKET_IFNAME={netcluster.IFNAME}\n")
    (tmp_path / "home").mkdir()
    return tmp_path


def launcher_env(cluster: netcluster.Cluster, job: Path, **extra: str) -> dict[str, str]:
    return env_with(
        DS_ACCELERATOR="cpu",
        HOME=str(job / "home"),
        PDSH_SSH_ARGS_APPEND=" ".join(cluster.ssh_args),
        **extra,
    )


def ranks_get(job: Path, **env: str) -> None:
    """Variables for the ranks on every host go through .deepspeed_env (the launcher's own
    environment reaches them only for PYTHON*, NCCL*, GLOO*, DS_*, ... as upstream)."""
    with open(job / ".deepspeed_env", "a") as f:
        f.writelines(f"{k}={v}\n" for k, v in env.items())


def deepspeed(
    cluster: netcluster.Cluster,
    job: Path,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    **extra: str,
) -> subprocess.CompletedProcess[str]:
    """The launcher in `job` with `env` added to its own environment; `extra` goes to the
    ranks (through .deepspeed_env)."""
    ranks_get(job, **extra)
    cmd = [sys.executable, "-m", "deepspeed_ext.launcher.runner", "--hostfile", "hostfile", *args]
    return subprocess.run(
        cmd,
        cwd=job,
        env=launcher_env(cluster, job, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_nothing_left(cluster: netcluster.Cluster, within: float = 0.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = {h: cluster.processes(i) for i, h in enumerate(cluster.hosts)}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"processes left on the hosts: {left}"
        time.sleep(0.1)


def test_ranks_start_on_every_host_with_their_place_and_arguments(cluster, job):
    r = deepspeed(cluster, job, "rank.py", "two words", "50%", "it's")
    assert r.returncode == 0, r.stderr[-3000:]
    said = sorted(re.findall(r"<rank [^>]*>", r.stdout))  # ranks' prints may interleave
    h0, h1 = cluster.hosts
    args = "args ['--local_rank={}', 'two words', '50%', \"it's\"]"
    assert said == [
        f"<rank {rank}/4 on {host} local {rank % 2} sum 10 {args.format(rank % 2)}>"
        for host, rank in ((h0, 0), (h0, 1), (h1, 2), (h1, 3))
    ], r.stdout
    # rank 0's address is the first host's, found by ssh as upstream does
    assert f"master {h0}:" in r.stderr
    assert_nothing_left(cluster)


def test_ssh_port_appends_to_the_users_ssh_options(cluster, job):
    # The user's PDSH_SSH_ARGS_APPEND carries the only key the hosts accept: were it replaced
    # by `-p 22`, ssh could not log in. --launcher_args reach pdsh: -N drops its host prefix.
    r = deepspeed(cluster, job, "--ssh_port", "22", "--launcher_args=-N", "rank.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"<rank [^>]*>", r.stdout)) == 4, r.stdout
    assert not any(ln.startswith(tuple(cluster.hosts)) for ln in r.stdout.splitlines())


def test_a_failed_rank_stops_every_host_and_its_exit_is_the_jobs(cluster, job):
    hang = str(job / "hang")
    r = deepspeed(cluster, job, "rank.py", FAIL_RANK="3", HANG=hang)
    ended = time.time()
    assert r.returncode == 7, r.stderr[-3000:]
    h1 = cluster.hosts[1]
    # the runner names the rank, its host and the tail of its stderr
    assert f"rank 3 on host {h1} (pid " in r.stderr and "exited with code 7" in r.stderr
    tail = r.stderr[r.stderr.index(f"stderr lines of rank 3 on {h1}:") :]
    assert "rank 3 fails on purpose" in tail
    # ranks 0-2 sleep for 10 minutes: only the teardown ends them, on both hosts
    assert sorted(p.name for p in job.glob("hang.*")) == ["hang.0", "hang.1", "hang.2"]
    failed_at = float(re.search(r"fails on purpose at ([\d.]+)", r.stderr)[1])
    assert ended - failed_at < 10, ended - failed_at  # every host down, the launcher exited
    assert_nothing_left(cluster)


def test_a_rank_killed_by_a_signal_is_reported_as_such(cluster, job):
    r = deepspeed(cluster, job, "rank.py", FAIL_RANK="0", FAIL_HOW="kill", HANG=str(job / "h"))
    assert r.returncode == 137, r.stderr[-3000:]
    assert f"rank 0 on host {cluster.hosts[0]}" in r.stderr and "SIGKILL" in r.stderr
    assert_nothing_left(cluster)


def _start_hanging(cluster, job) -> tuple[subprocess.Popen[str], list[Path]]:
    cmd = [sys.executable, "-m", "deepspeed_ext.launcher.runner", "--hostfile", "hostfile"]
    ranks_get(job, HANG=str(job / "hang"))
    proc = subprocess.Popen(
        [*cmd, "rank.py"],
        cwd=job,
        env=launcher_env(cluster, job),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    marks = [job / f"hang.{r}" for r in range(4)]
    deadline = time.monotonic() + 60
    while not all(m.exists() for m in marks):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return proc, marks


def test_ctrl_c_stops_every_host(cluster, job):
    proc, _ = _start_hanging(cluster, job)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "received SIGINT; stopping the job on 2 host(s)" in err
    assert_nothing_left(cluster, within=max(0.0, 10 - (time.monotonic() - start)))


def test_a_killed_runner_leaves_no_rank_behind(cluster, job):
    # SIGKILL gives the runner no chance to stop anything: the hosts see its control
    # connection close and stop their own ranks.
    proc, _ = _start_hanging(cluster, job)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its pdsh/ssh
    proc.communicate(timeout=30)
    assert_nothing_left(cluster, within=max(1.0, 10 - (time.monotonic() - start)))


def test_an_unreachable_host_is_reported_before_anything_starts(cluster, job):
    nowhere = cluster.hosts[0].rsplit(".", 1)[0] + ".250"  # on the bridge's subnet, no host
    (job / "hostfile").write_text(f"{cluster.hosts[0]} slots=1\n{nowhere} slots=1\n")
    r = deepspeed(cluster, job, "rank.py", HANG=str(job / "hang"), timeout=60)
    assert r.returncode == 1
    assert "1 of 2 host(s) cannot be reached by ssh, so nothing was started" in r.stderr
    assert f"    {nowhere}: " in r.stderr and f"    {cluster.hosts[0]}:" not in r.stderr
    assert not list(job.glob("hang.*"))
    assert_nothing_left(cluster)


def test_each_rank_logs_to_its_own_file_on_every_host(cluster, job):
    r = deepspeed(cluster, job, "--enable_each_rank_log", str(job / "logs"), "rank.py")
    assert r.returncode == 0, r.stderr[-3000:]
    # <YYYYmmddHHMMSS>_rank<N>.log; each host stamps its own, maybe a second apart
    logs = sorted((job / "logs").iterdir(), key=lambda p: p.name.rsplit("_", 1)[1])
    assert [p.name.rsplit("_", 1)[1] for p in logs] == [f"rank{i}.log" for i in range(4)]
    for i, p in enumerate(logs):
        assert f"<rank {i}/4" in p.read_text()


def test_open_mpi_starts_the_ranks_on_every_host(cluster, job):
    why = netcluster.openmpi_unavailable()
    if why is not None:
        pytest.skip(why)
    mpi = ["--launcher", "openmpi"]
    r = deepspeed(cluster, job, *mpi, "rank.py", "two words", env=cluster.openmpi_env())
    assert r.returncode == 0, r.stderr[-3000:]
    said = sorted(re.findall(r"<rank [^>]*>", r.stdout))
    h0, h1 = cluster.hosts
    assert said == [  # Open MPI passes no --local_rank; its variables place the ranks
        f"<rank {rank}/4 on {host} local {rank % 2} sum 10 args ['two words']>"
        for host, rank in ((h0, 0), (h0, 1), (h1, 2), (h1, 3))
    ], r.stdout
    assert "(from Open MPI (OMPI_COMM_WORLD_RANK))" in r.stderr
    # mpirun stops every rank when one fails, and the job fails
    r = deepspeed(
        cluster,
        job,
        *mpi,
        "rank.py",
        FAIL_RANK="3",
        HANG=str(job / "hang"),
        env=cluster.openmpi_env(),
    )
    assert r.returncode != 0
    assert "rank 3 fails on purpose" in r.stderr
    assert_nothing_left(cluster, within=10)


def test_the_main_job_across_two_hosts_matches_one_host(cluster, job, tmp_path_factory):
    """examples/train_tiny_gpt.py, 1 rank per host, against 2 ranks on one node: the same
    model, bit for bit."""
    import torch

    steps = ["--steps", "40", "--print-every", "20"]
    main = str(ROOT / "examples" / "train_tiny_gpt.py")
    (job / "hostfile").write_text("".join(f"{h} slots=1\n" for h in cluster.hosts))
    # one thread per rank on both sides: a host with 1 rank would otherwise take both cores
    # and sum its matmuls in another order
    r = deepspeed(
        cluster, job, main, *steps, "--out", str(job / "out"), timeout=300, OMP_NUM_THREADS="1"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks x micro-batch" in r.stdout + r.stderr

    local = tmp_path_factory.mktemp("one_node")
    one = subprocess.run(
        [sys.executable, "-m", "deepspeed_ext.launcher.runner", "--num_gpus", "2", main, *steps]
        + ["--out", str(local / "out")],
        cwd=local,
        env=env_with(DS_ACCELERATOR="cpu", HOME=str(job / "home"), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    name = "checkpoints/global_step40/mp_rank_00_model_states.pt"
    a = torch.load(job / "out" / name, weights_only=True)["module"]
    b = torch.load(local / "out" / name, weights_only=True)["module"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert_nothing_left(cluster)

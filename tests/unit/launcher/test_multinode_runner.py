"""The multi-node backends' commands (as upstream builds them, without its faults), the
launcher's multi-node argument errors, a Slurm job simulated by its variables, MPI rank
discovery, and --no_ssh (each node started by hand)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepspeed_ext.comm.env import discover, free_port
from deepspeed_ext.launcher import multinode_runner as mr
from deepspeed_ext.launcher.launch import node_rank_of
from deepspeed_ext.launcher.multinode import add_exports, ssh_options
from deepspeed_ext.launcher.runner import parse_args
from tests.helpers.subproc import env_with

ACTIVE = {"w0": [0, 1], "w1": [0, 1]}


def args(*argv: str):
    return parse_args([*argv, "train.py", "--lr", "0.1", "two words"])


def test_pdsh_command_runs_the_node_launcher_with_quoted_arguments():
    a = args("--master_addr", "10.0.0.1", "--master_port", "1234", "--module")
    runner = mr.PDSHRunner(a, "d29ybGQ=")
    runner.control = "10.0.0.9:4000:tok"
    runner.add_export("PYTHONPATH", "/a b:/c")
    runner.add_export("NCCL_X", "50%")
    env: dict[str, str] = {"PDSH_SSH_ARGS_APPEND": "-i /k -o X=1"}
    a.ssh_port = 2222
    cmd = runner.get_cmd(env, ACTIVE)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1"]
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    assert env["PDSH_SSH_ARGS_APPEND"] == "-i /k -o X=1 -p 2222"  # appended, never replaced
    remote = cmd[-1]
    # pdsh substitutes %n/%h; a literal % is written %%
    assert "export PYTHONPATH='/a b:/c'; export NCCL_X=50%%; " in remote
    assert "--node_rank=%n --node_host=%h" in remote and "--control=10.0.0.9:4000:tok" in remote
    words = shlex.split(remote.split(f"cd {os.path.abspath('.')}; ", 1)[1])
    assert words[:4] == [sys.executable, "-u", "-m", "deepspeed_ext.launcher.launch"]
    assert words[-5:] == ["--module", "train.py", "--lr", "0.1", "two words"]
    assert "--master_addr=10.0.0.1" in words and "--master_port=1234" in words
    # the last resort kills this job's node launchers only: by the job's control token
    assert runner.kill_cmd(ACTIVE)[-1] == "pkill -TERM -f tok"
    assert mr.PDSHRunner(a, "x").kill_cmd(ACTIVE) == []  # no token: nothing to match safely


def test_launcher_args_reach_the_backend():
    cmd = mr.PDSHRunner(args("--launcher_args=-N -u 30"), "x").get_cmd({}, ACTIVE)
    assert cmd[6:9] == ["-N", "-u", "30"]


def test_openmpi_command_uses_a_hostfile_of_the_active_hosts(tmp_path):
    a = args("--launcher", "openmpi", "--master_addr", "w0", "--launcher_args=--mca x y")
    runner = mr.OpenMPIRunner(a, "x", {"w0": 4, "w1": 4})
    runner.add_export("PYTHONPATH", "/p")
    cmd = runner.get_cmd({}, ACTIVE)  # include/exclude left 2 slots per host of 4
    assert cmd[:3] == ["mpirun", "-n", "4"]
    hostfile = Path(cmd[cmd.index("-hostfile") + 1])
    assert hostfile.read_text() == "w0 slots=2\nw1 slots=2\n"
    assert "btl_tcp_if_include" not in cmd  # no eth0 assumed
    assert ["--mca", "x", "y"] == cmd[cmd.index("^openib") + 1 : cmd.index("^openib") + 4]
    exports = [cmd[i + 1] for i, w in enumerate(cmd) if w == "-x"]
    for kv in ("PYTHONPATH=/p", "MASTER_ADDR=w0", "MASTER_PORT=29500", "WORLD_SIZE=4"):
        assert kv in exports
    assert cmd[-6:] == [sys.executable, "-u", "train.py", "--lr", "0.1", "two words"]


def test_mpich_impi_and_mvapich_need_the_same_ranks_per_host():
    uneven = {"w0": [0, 1], "w1": [0]}
    for cls in (mr.MPICHRunner, mr.IMPIRunner, mr.MVAPICHRunner):
        runner = cls(args(), "x", {"w0": 2, "w1": 1})
        with pytest.raises(
            ValueError, match=r"same number of ranks on every host \(w0: 2, w1: 1\)"
        ):
            runner.get_cmd({}, uneven)


def test_mpich_and_impi_commands():
    cmd = mr.MPICHRunner(args("--master_addr", "w0"), "x", {}).get_cmd({}, ACTIVE)
    assert cmd[:5] == ["mpirun", "-n", "4", "-ppn", "2"]
    assert cmd[cmd.index("-hosts") + 1] == "w0,w1"
    assert ["-genv", "LOCAL_SIZE", "2"] == cmd[
        cmd.index("LOCAL_SIZE") - 1 : cmd.index("LOCAL_SIZE") + 2
    ]
    impi = mr.IMPIRunner(args("--master_addr", "w0"), "x", {}).get_cmd({}, ACTIVE)
    per_rank = " ".join(impi).split(" : ")
    assert len(per_rank) == 4
    assert "-env RANK 3 -env LOCAL_RANK 1" in per_rank[3]
    assert "-genv I_MPI_PIN 0" in per_rank[0]


def test_slurm_command_names_the_hosts_and_ends_the_step_on_a_failure():
    cmd = mr.SlurmRunner(args("--master_addr", "w0"), "x", {}).get_cmd({}, ACTIVE)
    assert cmd[:9] == [
        "srun",
        "-n",
        "4",
        "--nodes",
        "2",
        "--nodelist",
        "w0,w1",
        "--ntasks-per-node",
        "2",
    ]
    assert "--kill-on-bad-exit=1" in cmd
    export = next(w for w in cmd if w.startswith("--export="))
    assert export.startswith("--export=ALL,") and "MASTER_ADDR=w0" in export
    given = mr.SlurmRunner(args("--launcher_args=-K0"), "x", {}).get_cmd({}, ACTIVE)
    assert "--kill-on-bad-exit=1" not in given and "-K0" in given
    runner = mr.SlurmRunner(args(), "x", {})
    runner.add_export("A", "1,2")
    with pytest.raises(ValueError, match="cannot export A='1,2': it contains a comma"):
        runner.get_cmd({}, ACTIVE)


def test_exports_follow_upstreams_prefixes_and_the_env_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = mr.PDSHRunner(args(), "x")
    env = {"PYTHONPATH": "/x", "NCCL_DEBUG": "INFO", "DS_ACCELERATOR": "cpu", "SECRET": "no"}
    add_exports(runner, env, {"FROM_FILE": "1"})
    assert runner.exports == {
        "PYTHONPATH": f"{tmp_path}:/x",  # the job's folder first, as upstream
        "NCCL_DEBUG": "INFO",
        "DS_ACCELERATOR": "cpu",
        "FROM_FILE": "1",
    }
    assert ssh_options({"PDSH_SSH_ARGS_APPEND": "-i 'a b'"}, 22) == ["-i", "a b", "-p", "22"]


def test_node_launcher_finds_its_place_by_name():
    hosts = {"b": [0], "a": [0]}
    assert node_rank_of(hosts, 0, "a") == 1
    assert node_rank_of(hosts, 1, "") == 1
    with pytest.raises(ValueError, match=r"--node_host c is not in the job's hosts \['b', 'a'\]"):
        node_rank_of(hosts, 0, "c")
    with pytest.raises(ValueError, match=r"--node_rank 2 is outside 0..1"):
        node_rank_of(hosts, 2, "")


@pytest.mark.parametrize(
    "env, want",
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "MASTER_ADDR": "w0",
            },
            (3, 4, 1, "w0"),
        ),
        (
            {
                "MV2_COMM_WORLD_RANK": "2",
                "MV2_COMM_WORLD_SIZE": "4",
                "MV2_COMM_WORLD_LOCAL_RANK": "0",
                "MASTER_ADDR": "w1",
            },
            (2, 4, 0, "w1"),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            (1, 2, 1, "127.0.0.1"),
        ),
    ],
)
def test_mpi_ranks_find_their_place(env, want):
    got = discover(env)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr) == want


def test_mpi_ranks_across_hosts_need_master_addr():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(ValueError, match="MPICH/Intel MPI job across nodes without MASTER_ADDR"):
        discover(env)


def run_deepspeed(tmp_path: Path, *argv: str, path: str | None = None, timeout: float = 120):
    extra = {"PATH": path} if path else {}
    return subprocess.run(
        [sys.executable, "-m", "deepspeed_ext.launcher.runner", *argv],
        cwd=tmp_path,
        env=env_with(DS_ACCELERATOR="cpu", HOME=str(tmp_path), **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_launcher_errors_name_the_argument(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    r = run_deepspeed(tmp_path, "-H", "hostfile", "--launcher", "nosuch", "x.py")
    assert r.returncode == 2 and "invalid choice: 'nosuch'" in r.stderr
    r = run_deepspeed(
        tmp_path, "-H", "hostfile", "--launcher", "mvapich", "x.py", path="/nonexistent"
    )
    assert r.returncode == 1
    assert "--launcher mvapich needs `mpiname`, which is not on PATH" in r.stderr
    r = run_deepspeed(tmp_path, "-H", "hostfile", "--no_ssh", "x.py")
    assert r.returncode == 1 and "--no_ssh needs --node_rank between 0 and 1" in r.stderr
    r = run_deepspeed(tmp_path, "--node_rank", "1", "x.py")
    assert r.returncode == 1 and "--node_rank only goes with --no_ssh" in r.stderr


RANK = """
import os, sys, time
import torch, torch.distributed as dist
import deepspeed_ext.comm as comm
comm.init_distributed()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"<rank {dist.get_rank()}/{dist.get_world_size()} local {comm.get_local_rank()} "
      f"sum {t.item():g} {os.environ.get('SLURM_PROCID', '-')} {sys.argv[1:]}>", flush=True)
fail = os.environ.get("FAIL_RANK")
if fail is not None:  # the others wait outside any collective, for srun to stop them
    sys.exit(5) if dist.get_rank() == int(fail) else time.sleep(60)
dist.barrier()
"""

# srun as far as the launcher uses it: -n tasks over --nodelist, SLURM_* per task, --export,
# and --kill-on-bad-exit. Every "node" is this machine.
FAKE_SRUN = """
import os, subprocess, sys, time
a = sys.argv[1:]
opts = {}
while a[0].startswith("-"):
    key = a.pop(0)
    if "=" in key:
        k, v = key.split("=", 1); opts[k] = v
    else:
        opts[key] = a.pop(0)
n, nodes = int(opts["-n"]), opts["--nodelist"].split(",")
per = int(opts["--ntasks-per-node"])
env = dict(os.environ)
for kv in opts["--export"].split(",")[1:]:
    k, v = kv.split("=", 1); env[k] = v
procs = [subprocess.Popen(a, env={**env, "SLURM_PROCID": str(i), "SLURM_NTASKS": str(n),
         "SLURM_LOCALID": str(i % per), "SLURM_NODEID": str(i // per),
         "SLURM_JOB_NODELIST": ",".join(nodes)}) for i in range(n)]
while any(p.poll() is None for p in procs):
    if opts.get("--kill-on-bad-exit") == "1" and any(p.poll() for p in procs):
        for p in procs: p.kill()
    time.sleep(0.05)
sys.exit(max(p.returncode for p in procs))
"""


def _slurm_job(tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"#!{sys.executable}\n{textwrap.dedent(FAKE_SRUN)}")
    srun.chmod(0o755)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "hostfile").write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    return f"{bin_dir}:{os.environ['PATH']}"


def test_a_slurm_job_simulated_by_its_variables(tmp_path):
    path = _slurm_job(tmp_path)
    r = run_deepspeed(
        tmp_path, "-H", "hostfile", "--launcher", "slurm", "rank.py", "x y", path=path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    said = sorted(re.findall(r"<rank [^>]*>", r.stdout))
    assert said == [f"<rank {i}/4 local {i % 2} sum 10 {i} ['x y']>" for i in range(4)], r.stdout
    # a failed task fails the job with its code
    (tmp_path / ".deepspeed_env").write_text("FAIL_RANK=2\n")
    r = run_deepspeed(tmp_path, "-H", "hostfile", "--launcher", "slurm", "rank.py", path=path)
    assert r.returncode == 5, r.stderr[-3000:]


def test_no_ssh_starts_one_node_of_a_job_per_command(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    common = ["-H", "hostfile", "--no_ssh", "--master_port", port]
    env = env_with(DS_ACCELERATOR="cpu", HOME=str(tmp_path))
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepspeed_ext.launcher.runner",
                *common,
                "--node_rank",
                str(i),
                "rank.py",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert "<rank 0/2 local 0 sum 3 - ['--local_rank=0']>" in outs[0][0]
    assert "<rank 1/2 local 0 sum 3 - ['--local_rank=0']>" in outs[1][0]
    assert "1 of 2 rank(s) on 127.0.0.1" in outs[1][1]

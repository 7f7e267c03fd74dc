"""The `deepspeed` launcher with real processes: env contract, script modes, failures and
signals tear everything down (grandchildren too), free port, config checked before spawn."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from deepspeed_ext.launcher.launch import KILL_GRACE_S
from tests.helpers.subproc import env_with

KILL_BUDGET_S = 10.0


def config_landed() -> bool:
    try:
        from deepspeed_ext.config import validate_cli, validate_config_file  # noqa: F401
    except ImportError:
        return False
    return True


needs_config = pytest.mark.skipif(not config_landed(), reason="deepspeed_ext.config not landed")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    # CPU ranks on any machine; a private HOME so no user ~/.deepspeed_env leaks in
    return env_with(**{"DS_ACCELERATOR": "cpu", "HOME": str(home), **extra})


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deepspeed_ext.launcher.runner", *args]


def deepspeed(tmp_path: Path, *args: str, timeout: float = 30, **extra: str):
    return subprocess.run(
        _cmd(*args),
        cwd=tmp_path,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def script(tmp_path: Path, body: str, name: str = "rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def marker() -> str:
    return f"--marker=dslt-{uuid.uuid4().hex}"


def leftovers(mark: str) -> list[str]:
    # -ww: else ps cuts the lines to a width it guesses (80 under pytest), and the marker,
    # last on each command line, is never seen
    ps = subprocess.run(
        ["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True
    ).stdout
    return [line for line in ps.splitlines() if mark in line and "Z" not in line.split()[1]]


def wait_for_files(paths: list[Path], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.05)


DUMP = """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "FROM_HOME", "FROM_CWD", "SHARED",
            "CUDA_VISIBLE_DEVICES"]
    out = {k: os.environ.get(k) for k in keys}
    out["argv"] = sys.argv[1:]
    with open(f"out_{os.environ['RANK']}.json", "w") as f:
        json.dump(out, f)
"""


def outputs(tmp_path: Path, n: int) -> list[dict]:
    return [json.loads((tmp_path / f"out_{r}.json").read_text()) for r in range(n)]


def test_env_contract_local_rank_and_deepspeed_env(tmp_path):
    (tmp_path / "home" / ".deepspeed_env").parent.mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (tmp_path / ".deepspeed_env").write_text("# project settings\nFROM_CWD=yes\nSHARED=cwd\n")
    r = deepspeed(tmp_path, "--num_gpus", "2", script(tmp_path, DUMP), "a", "--b=1")
    assert r.returncode == 0, r.stderr
    for rank, out in enumerate(outputs(tmp_path, 2)):
        assert out["argv"] == [f"--local_rank={rank}", "a", "--b=1"]
        assert (out["RANK"], out["LOCAL_RANK"]) == (str(rank), str(rank))
        assert out["WORLD_SIZE"] == out["LOCAL_WORLD_SIZE"] == out["LOCAL_SIZE"] == "2"
        assert (out["CROSS_RANK"], out["CROSS_SIZE"]) == ("0", "1")
        assert out["MASTER_ADDR"] == "127.0.0.1" and int(out["MASTER_PORT"]) > 0
        # both .deepspeed_env files are exported; the one in the current folder wins
        assert (out["FROM_HOME"], out["FROM_CWD"], out["SHARED"]) == ("1", "yes", "cwd")
    assert "2 rank(s) on localhost (CPU)" in r.stderr


def test_no_local_rank_and_hostfile_include(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node\nlocalhost slots=4\n")
    r = deepspeed(
        tmp_path,
        "-H",
        str(hostfile),
        "--include",
        "localhost:1,3",
        "--no_local_rank",
        script(tmp_path, DUMP),
        "x",
    )
    assert r.returncode == 0, r.stderr
    outs = outputs(tmp_path, 2)
    assert [o["argv"] for o in outs] == [["x"], ["x"]]
    assert [o["LOCAL_RANK"] for o in outs] == ["0", "1"] and outs[0]["WORLD_SIZE"] == "2"


def test_gpu_node_respects_cuda_visible_devices(tmp_path):
    """A node with 4 GPUs (a stand-in nvidia-smi) and CUDA_VISIBLE_DEVICES=3,1: one rank per
    visible GPU, each told all of them, LOCAL_RANK indexing them."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done\n'
    )
    (fake / "nvidia-smi").chmod(0o755)
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    env = dict(PATH=path, DS_ACCELERATOR="", CUDA_VISIBLE_DEVICES="3,1")
    r = deepspeed(tmp_path, script(tmp_path, DUMP), **env)
    assert r.returncode == 0, r.stderr
    outs = outputs(tmp_path, 2)
    assert [o["CUDA_VISIBLE_DEVICES"] for o in outs] == ["3,1", "3,1"]
    assert [o["LOCAL_RANK"] for o in outs] == ["0", "1"] and outs[0]["WORLD_SIZE"] == "2"
    assert "2 rank(s) on localhost (GPU(s) 3,1)" in r.stderr

    r = deepspeed(tmp_path, "--num_gpus", "1", script(tmp_path, DUMP), **env)
    assert r.returncode == 0, r.stderr
    assert outputs(tmp_path, 1)[0]["CUDA_VISIBLE_DEVICES"] == "3"


def test_per_node_entry(tmp_path):
    """`python -m deepspeed_ext.launcher.launch`, what a multi-node runner starts per host."""
    from deepspeed_ext.launcher.env import encode_world_info

    info = encode_world_info({"a": [0], "b": [0, 1]})
    r = subprocess.run(
        [sys.executable, "-m", "deepspeed_ext.launcher.launch", f"--world_info={info}",
         "--node_rank=1", "--master_port=1234", script(tmp_path, DUMP)],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    outs = [json.loads((tmp_path / f"out_{k}.json").read_text()) for k in (1, 2)]
    assert [(o["RANK"], o["LOCAL_RANK"]) for o in outs] == [("1", "0"), ("2", "1")]
    assert {
        (o["WORLD_SIZE"], o["CROSS_RANK"], o["CROSS_SIZE"], o["MASTER_PORT"]) for o in outs
    } == {("3", "1", "2", "1234")}


def test_module_and_no_python(tmp_path):
    script(tmp_path, DUMP, name="dumpmod.py")
    r = deepspeed(tmp_path, "--module", "dumpmod", "m")
    assert r.returncode == 0, r.stderr
    assert outputs(tmp_path, 1)[0]["argv"] == ["--local_rank=0", "m"]

    exe = tmp_path / "run.sh"
    exe.write_text('#!/bin/sh\necho "$RANK $*" > "out_sh_$RANK.txt"\n')
    exe.chmod(0o755)
    r = deepspeed(tmp_path, "--no_python", "--num_gpus", "2", str(exe), "y")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out_sh_1.txt").read_text() == "1 --local_rank=1 y\n"

    r = deepspeed(tmp_path, "--module", "--no_python", "dumpmod")
    assert r.returncode == 1 and "cannot be used together" in r.stderr


FAILING = """
    import os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    mark = sys.argv[-1]
    if rank == 1:
        while not os.path.exists("ready_2"):  # rank 2's grandchild is up
            time.sleep(0.02)
        for i in range(30):
            print(f"rank1 line {i}", file=sys.stderr)
        if "--sigkill" in sys.argv:
            os.kill(os.getpid(), 9)
        sys.exit(3)
    if rank == 2:  # a grandchild in the rank's process group must go too
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", mark])
        open("ready_2", "w").close()
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit3", "sigkill"])
def test_failing_rank_stops_all_ranks(tmp_path, how):
    mark = marker()
    extra = ["--sigkill"] if how == "sigkill" else []
    t0 = time.monotonic()
    r = deepspeed(tmp_path, "--num_gpus", "3", script(tmp_path, FAILING), *extra, mark)
    elapsed = time.monotonic() - t0
    assert elapsed < KILL_BUDGET_S, elapsed
    if how == "exit3":
        assert r.returncode == 3, r.stderr
        assert re.search(r"rank 1 \(pid \d+\) exited with code 3; stopping the other 2", r.stderr)
    else:
        assert r.returncode == 128 + 9, r.stderr
        assert "rank 1" in r.stderr and "was killed by SIGKILL" in r.stderr
    # the tail: the last 20 lines, indented, after the teed [rank 1] lines
    tail = r.stderr.split("stderr lines of rank 1:")[1]
    assert "    rank1 line 29" in tail and "    rank1 line 10\n" in tail
    assert "rank1 line 9\n" not in tail
    assert "[rank 1] rank1 line 0" in r.stderr
    assert not leftovers(mark), leftovers(mark)


STUBBORN = """
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    if rank == 0:  # ignores SIGTERM: only the SIGKILL after the grace period stops it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(60)", sys.argv[-1]])
    open(f"ready_{rank}", "w").close()
    time.sleep(60)
"""


@pytest.mark.parametrize("sig, times", [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_signal_to_launcher_stops_all(tmp_path, sig, times):
    """One signal: SIGTERM to every rank group, SIGKILL after the grace for what ignores it.
    A second one (Ctrl-C twice) skips the grace."""
    mark = marker()
    proc = subprocess.Popen(
        _cmd("--num_gpus", "2", script(tmp_path, STUBBORN), mark),
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files([tmp_path / "ready_0", tmp_path / "ready_1"])
        time.sleep(0.3)  # rank 0's grandchild is up too
        t0 = time.monotonic()
        proc.send_signal(sig)
        if times == 2:
            time.sleep(0.5)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=KILL_BUDGET_S + 5)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"received {signal.Signals(sig).name}; stopping 2 rank(s)" in err
    if times == 1:
        assert KILL_GRACE_S - 0.5 < elapsed < KILL_BUDGET_S, elapsed
    else:
        assert elapsed < 3, elapsed
    assert not leftovers(mark), leftovers(mark)


def test_free_port_when_default_is_taken(tmp_path):
    with socket.socket() as s:
        # a connection of an earlier test in TIME_WAIT on 29500 must not make the bind fail
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", 29500))
            s.listen()
        except OSError:
            pass  # someone else holds it already: just as good
        r = deepspeed(tmp_path, script(tmp_path, DUMP))
    assert r.returncode == 0, r.stderr
    port = int(outputs(tmp_path, 1)[0]["MASTER_PORT"])
    assert port != 29500
    assert f"master port 29500 is in use; using free port {port}" in r.stderr


def test_master_port_0_means_any_free_port(tmp_path):
    """Passed through, port 0 left every rank but rank 0 connecting to port 0 forever."""
    r = deepspeed(tmp_path, "--master_port", "0", script(tmp_path, DUMP))
    assert r.returncode == 0, r.stderr
    port = int(outputs(tmp_path, 1)[0]["MASTER_PORT"])
    assert port > 0


def test_each_rank_log(tmp_path):
    body = "import os, sys\nprint('out', os.environ['RANK'])\nprint('err', file=sys.stderr)\n"
    r = deepspeed(
        tmp_path, "--num_gpus", "2", "--enable_each_rank_log", "logs", script(tmp_path, body)
    )
    assert r.returncode == 0, r.stderr
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert len(logs) == 2 and all(re.fullmatch(r"\d{14}_rank[01]\.log", n) for n in logs), logs
    for rank, name in enumerate(logs):
        text = (tmp_path / "logs" / name).read_text()
        assert f"out {rank}" in text and "err" in text


def test_bad_launcher_options_are_named_before_any_rank_starts(tmp_path):
    """Each was a raw traceback, or a rank's, after it started."""
    (tmp_path / "afile").write_text("")
    body = script(tmp_path, DUMP)
    usable = max(os.sched_getaffinity(0))
    for args, said in [
        (["--master_port", "70000"], "--master_port 70000: a port is 0-65535"),
        (
            ["--bind_cores_to_rank", "--bind_core_list", f"{usable + 1}"],
            f"core(s) {usable + 1} are not among the cores this process may use",
        ),
        (["--enable_each_rank_log", "afile/logs"], "afile/logs: cannot create it"),
    ]:
        r = deepspeed(tmp_path, *args, body)
        assert r.returncode != 0 and "deepspeed: error: --" in r.stderr, r.stderr
        assert said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not list(tmp_path.glob("out_*")), args  # no rank ran


def test_the_rank_that_failed_first_is_named_not_the_peer_it_broke(tmp_path):
    # Rank 1 exits with 5 while rank 0 waits in a barrier; rank 0 then fails with 1
    # ("connection closed") and, with less to tear down, ends first. [Note: who failed first]
    body = """
        import sys
        import torch.distributed as dist
        import deepspeed_ext.comm as comm
        comm.init_distributed()
        dist.barrier()
        if dist.get_rank() == 1:
            sys.exit(5)
        dist.barrier()
    """
    for _ in range(2):
        r = deepspeed(tmp_path, "--num_gpus", "2", script(tmp_path, body), timeout=60)
        assert r.returncode == 5, r.stderr[-2000:]
        assert "deepspeed: rank 1 (pid" in r.stderr and "exited with code 5" in r.stderr


def test_hosts_that_cannot_be_reached_are_named_before_anything_starts(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    ran = tmp_path / "ran"
    body = f"open({str(ran)!r}, 'w').close()\n"
    r = deepspeed(tmp_path, "-H", str(hostfile), script(tmp_path, body))
    assert r.returncode == 1
    if shutil.which("pdsh") is None:
        assert "--launcher pdsh needs `pdsh`, which is not on PATH" in r.stderr
    else:  # no such hosts: ssh cannot resolve them
        assert "2 of 2 host(s) cannot be reached by ssh, so nothing was started" in r.stderr
        assert "    worker-0: " in r.stderr and "    worker-1: " in r.stderr
    assert not ran.exists()
    # the filters pick one host of it: that runs here, as upstream
    r = deepspeed(tmp_path, "-H", str(hostfile), "--include", "worker-1:1", script(tmp_path, body))
    assert r.returncode == 0, r.stderr
    assert ran.exists()


def test_launcher_starts_without_torch():
    code = (
        "import sys\n"
        "import deepspeed_ext.launcher.runner, deepspeed_ext.launcher.launch\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env_with(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_face_re_exports_upstream_names():
    from deepspeed.launcher import runner as face
    from deepspeed_ext.launcher import runner

    assert face.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert face.main is runner.main
    assert face.parse_resource_filter is runner.parse_resource_filter


def test_console_script_is_installed():
    exe = shutil.which("deepspeed")
    assert exe, "pip install -e . should install the deepspeed script"
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--num_gpus" in r.stdout and "--include" in r.stdout


CONFIG_OK = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}
CONFIG_TYPO = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clippin": 1}
CONFIG_ODD = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}  # not for 2 ranks
CONFIG_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}


@needs_config
def test_bad_config_is_caught_before_any_rank_starts(tmp_path):
    ran = tmp_path / "ran"
    rank = script(tmp_path, f"open({str(ran)!r}, 'w').close()\n")

    def run(config: dict, flag: str = "--deepspeed_config"):
        (tmp_path / "ds.json").write_text(json.dumps(config))
        return deepspeed(tmp_path, "--num_gpus", "2", rank, "--lr", "1", flag, "ds.json")

    r = run(CONFIG_TYPO)
    assert r.returncode == 1, r.stderr
    assert not ran.exists(), "a rank started despite the bad config"
    assert "gradient_clippin" in r.stderr and "did you mean" in r.stderr.lower(), r.stderr
    assert '"gradient_clipping"' in r.stderr and "no rank was started" in r.stderr

    r = run(CONFIG_ODD, "--deepspeed")
    assert r.returncode == 1 and not ran.exists(), r.stderr
    assert "--num_gpus 2 on the deepspeed launcher" in r.stderr, r.stderr

    # "auto": DeepSpeed's own flag has nobody to fill it in; HF Trainer's --deepspeed does
    assert run(CONFIG_AUTO).returncode == 1 and not ran.exists()
    r = run(CONFIG_AUTO, "--deepspeed")
    assert r.returncode == 0 and ran.exists(), r.stderr

    ran.unlink()
    r = run(CONFIG_OK)
    assert r.returncode == 0 and ran.exists(), r.stderr


@needs_config
def test_validate_exit_codes_without_torch(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps(CONFIG_OK))
    (tmp_path / "typo.json").write_text(json.dumps(CONFIG_TYPO))
    (tmp_path / "odd.json").write_text(json.dumps(CONFIG_ODD))
    code = (
        "import sys\n"
        "from deepspeed_ext.launcher.runner import main\n"
        "rc = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'torch imported by --validate'\n"
        "sys.exit(rc)\n"
    )
    cases = [
        (["--validate", "ok.json", "--world_size", "2"], 0),
        (["--validate=ok.json", "--world_size=1"], 0),
        (["--validate", "odd.json", "--world_size", "2"], 1),
        (["--validate", "odd.json", "--world_size", "3"], 0),
        (["--validate", "typo.json", "--world_size", "2"], 1),
        (["--validate", "missing.json", "--world_size", "2"], 1),
    ]
    for argv, expected in cases:
        r = subprocess.run(
            [sys.executable, "-c", code, *argv],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == expected, (argv, r.stdout + r.stderr)
        assert "torch imported" not in r.stderr


SLEEPER = """
    import os, subprocess, sys, time
    rank = int(os.environ["RANK"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[-1]])
    open(f"ready_{rank}", "w").close()
    time.sleep(60)
"""


def test_ranks_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher (the OOM killer, kill -9) leaves no rank nor grandchild behind:
    ranks run in sessions of their own, so only the launcher's reaper process can stop them."""
    mark = marker()
    proc = subprocess.Popen(
        _cmd("--num_gpus", "2", script(tmp_path, SLEEPER), mark),
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files([tmp_path / "ready_0", tmp_path / "ready_1"])
        time.sleep(0.3)  # the grandchildren are up too
        assert len(leftovers(mark)) == 5, leftovers(mark)  # the launcher, 2 ranks, 2 children
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + KILL_BUDGET_S
        while leftovers(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        for line in leftovers(mark):  # do not leave them running when the test fails
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not leftovers(mark), leftovers(mark)
    assert "the launcher ended without stopping its ranks; stopping 2" in err, err

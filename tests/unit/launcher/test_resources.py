"""In-process pieces of the launcher: resource resolution (GPU ids, CPU ranks, hostfile),
device detection, the rank environment, .deepspeed_env, config-argument discovery, ports."""

import socket

import pytest

from deepspeed_ext.launcher import devices
from deepspeed_ext.launcher.env import (
    EnvFileError,
    NodePlan,
    decode_world_info,
    encode_world_info,
    rank_env,
    read_deepspeed_env,
)
from deepspeed_ext.launcher.launch import ScriptSpec
from deepspeed_ext.launcher.ports import choose_master_port, port_in_use
from deepspeed_ext.launcher.procs import exit_code
from deepspeed_ext.launcher.runner import (
    LauncherError,
    config_argument,
    parse_args,
    resolve_resources,
)


def resolve(argv, pool=None, gpus=()):
    return resolve_resources(parse_args([*argv, "train.py"]), pool, list(gpus))


def test_cpu_defaults_to_one_rank_and_num_gpus_sets_the_count():
    r = resolve([])
    assert r.active == {"localhost": [0]} and r.devices is None and r.world_size == 1
    r = resolve(["--num_gpus", "3"])
    assert r.active == {"localhost": [0, 1, 2]} and r.devices is None
    assert r.source == "--num_gpus 3 on the deepspeed launcher"
    assert resolve(["--num_accelerators", "2"]).world_size == 2


@pytest.mark.parametrize("argv", [["--num_gpus", "0"], ["--num_gpus", "-3"], ["--num_nodes", "0"]])
def test_counts_below_one_are_refused(argv):
    """They ran 1 rank (or every node) unsaid."""
    with pytest.raises(LauncherError, match=f"{argv[0]} {argv[1]}: give 1 or more"):
        resolve(argv)


def test_a_port_in_time_wait_is_free_as_rank_0s_store_sees_it():
    """The last job's port in TIME_WAIT: the store binds it (SO_REUSEADDR), so the launcher
    must not move off a port the user named."""
    with socket.socket() as server:  # as torch's TCPStore listens: SO_REUSEADDR
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the side that closes first keeps TIME_WAIT on `port`
        client.close()
    assert not port_in_use(port)
    with socket.socket() as listener:  # a live listener still counts
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
        listener.listen()
        assert port_in_use(port)
    with pytest.raises(ValueError, match="--master_port 70000: a port is 0-65535"):
        choose_master_port(70000)


def test_gpus_default_to_all_visible_and_respect_cuda_visible_devices():
    r = resolve([], gpus=["0", "1", "2", "3"])
    assert r.world_size == 4 and r.devices == ["0", "1", "2", "3"]
    # CUDA_VISIBLE_DEVICES=2,3: slot ids are the device ids
    r = resolve(["--num_gpus", "1"], gpus=["2", "3"])
    assert r.active == {"localhost": [2]} and r.devices == ["2"]
    r = resolve(["--include", "localhost:3"], gpus=["2", "3"])
    assert r.devices == ["3"] and r.source == "--include localhost:3 on the deepspeed launcher"
    r = resolve(["--exclude", "localhost:2"], gpus=["2", "3"])
    assert r.devices == ["3"]
    with pytest.raises(LauncherError, match="only 2 GPU"):
        resolve(["--num_gpus", "4"], gpus=["2", "3"])


def test_uuid_devices_are_indexed():
    r = resolve(["--include", "localhost:1"], gpus=["GPU-aaa", "GPU-bbb"])
    assert r.devices == ["GPU-bbb"]


def test_hostfile_pool_and_upstream_rules():
    pool = {"localhost": 4}
    r = resolve(["--include", "localhost:1,3"], pool=pool, gpus=["0", "1", "2", "3"])
    assert r.active == {"localhost": [1, 3]} and r.devices == ["1", "3"]
    assert resolve(["--num_gpus", "2"], pool=pool).active == {"localhost": [0, 1]}
    two = {"a": 2, "b": 2}
    assert resolve(["--num_nodes", "1"], pool=two).active == {"a": [0, 1]}
    assert resolve([], pool=two).world_size == 4
    with pytest.raises(LauncherError, match="cannot be combined"):
        resolve(["--num_gpus", "1", "--include", "a"], pool=two)
    with pytest.raises(LauncherError, match="needs a hostfile"):
        resolve(["--num_nodes", "2"])
    with pytest.raises(LauncherError, match="no slots left"):
        resolve(["--exclude", "localhost"], pool=pool)


def test_visible_devices_follow_cuda_rules():
    env = {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert devices.local_gpus(env, count=2) == ["1", "0"]
    assert devices.local_gpus({}, count=2) == ["0", "1"]
    assert devices.local_gpus({"CUDA_VISIBLE_DEVICES": ""}, count=2) == []
    assert devices.local_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, count=2) == []
    assert devices.local_gpus({"CUDA_VISIBLE_DEVICES": "0,5,1"}, count=2) == ["0"]  # stops at 5
    assert devices.local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-x"}, count=1) == ["GPU-x"]
    assert devices.local_gpus({"DS_ACCELERATOR": "cpu"}, count=8) == []
    assert devices.local_gpus({}, count=0) == []


def test_rank_env_contract():
    plan = NodePlan({"a": [0, 1], "b": [0, 1, 2]}, 1, "10.0.0.1", 1234, devices=["0", "1", "2"])
    env = rank_env({"KEEP": "1", "CUDA_VISIBLE_DEVICES": "7"}, plan, 2)
    assert env["KEEP"] == "1"
    assert env["RANK"] == "4" and env["LOCAL_RANK"] == "2"
    assert env["WORLD_SIZE"] == "5"
    assert env["LOCAL_WORLD_SIZE"] == env["LOCAL_SIZE"] == "3"
    assert env["CROSS_RANK"] == "1" and env["CROSS_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    cpu = NodePlan({"localhost": [0]}, 0, "127.0.0.1", 1)
    assert rank_env({"CUDA_VISIBLE_DEVICES": "7"}, cpu, 0)["CUDA_VISIBLE_DEVICES"] == "7"


def test_world_info_round_trip():
    info = {"worker-0": [0, 2], "worker-1": [1]}
    assert decode_world_info(encode_world_info(info)) == info


def test_deepspeed_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nB = here=there \nNCCL_X=1\n")
    assert read_deepspeed_env([str(home), str(cwd)]) == {
        "A": "home",
        "B": "here=there",
        "NCCL_X": "1",
    }
    (cwd / ".deepspeed_env").write_text("JUSTAKEY\n")
    with pytest.raises(EnvFileError, match=r"\.deepspeed_env:1: expected KEY=VALUE"):
        read_deepspeed_env([str(cwd)])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--deepspeed_config", "ds.json"], ("--deepspeed_config", "ds.json")),
        (["--lr", "1", "--deepspeed_config=cfg/ds.conf"], ("--deepspeed_config", "cfg/ds.conf")),
        (["--deepspeed", "ds.json"], ("--deepspeed", "ds.json")),
        (["--deepspeed=ds.json"], ("--deepspeed", "ds.json")),
        (["--deepspeed", "--other", "x.json"], None),  # upstream's bare --deepspeed switch
        (["--deepspeed"], None),
        (["x.json"], None),
    ],
)
def test_config_argument(args, expected):
    assert config_argument(args) == expected


def test_script_commands():
    spec = ScriptSpec("train.py", ["--x"])
    assert spec.command(1)[1:] == ["-u", "train.py", "--local_rank=1", "--x"]
    assert ScriptSpec("pkg.mod", module=True, no_local_rank=True).command(0)[1:] == [
        "-u",
        "-m",
        "pkg.mod",
    ]
    assert ScriptSpec("./run.sh", ["a"], no_python=True).command(0) == [
        "./run.sh",
        "--local_rank=0",
        "a",
    ]
    with pytest.raises(ValueError, match="cannot be used together"):
        ScriptSpec("x", module=True, no_python=True)


def test_exit_codes():
    assert exit_code(3) == 3 and exit_code(-9) == 137 and exit_code(-15) == 143


def test_port_choice():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert port_in_use(taken)
        port, note = choose_master_port(taken)
        assert port != taken and note and f"{taken} is in use" in note and str(port) in note
    free, note = choose_master_port(taken)
    assert (free, note) == (taken, None)


def test_cpu_threads_are_shared_out_unless_the_user_chose():
    from deepspeed_ext.launcher.env import threads_per_rank

    cores = len(__import__("os").sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1

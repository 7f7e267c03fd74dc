"""--bind_cores_to_rank / --bind_core_list: each rank runs on its own share of the cores with
OMP_NUM_THREADS set to it (real launcher jobs reading their affinity), and the NUMA helpers of
deepspeed.utils.numa."""

from __future__ import annotations

import json
import os

import pytest

from deepspeed.utils import numa as face
from deepspeed_ext.utils import numa

from .test_launch import deepspeed, script

AFFINITY = """
    import json, os
    with open(f"aff_{os.environ['RANK']}.json", "w") as f:
        json.dump({"cores": sorted(os.sched_getaffinity(0)),
                   "omp": os.environ.get("OMP_NUM_THREADS")}, f)
"""

CORES = sorted(os.sched_getaffinity(0))
no_numactl = pytest.mark.skipif(
    numa.check_for_numactl_pkg(), reason="numactl is installed: the launcher binds through it"
)


def affinity(tmp_path, n):
    return [json.loads((tmp_path / f"aff_{r}.json").read_text()) for r in range(n)]


@no_numactl
@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
def test_each_rank_gets_its_share_of_the_cores(tmp_path):
    r = deepspeed(tmp_path, "--num_gpus", "2", "--bind_cores_to_rank", script(tmp_path, AFFINITY))
    assert r.returncode == 0, r.stderr
    share = len(CORES) // 2
    for rank, out in enumerate(affinity(tmp_path, 2)):
        assert out["cores"] == CORES[rank * share : (rank + 1) * share]
        assert out["omp"] == str(share)


@no_numactl
def test_a_core_list_picks_the_cores(tmp_path):
    last = str(CORES[-1])
    r = deepspeed(
        tmp_path,
        "--num_gpus",
        "1",
        "--bind_cores_to_rank",
        "--bind_core_list",
        last,
        script(tmp_path, AFFINITY),
    )
    assert r.returncode == 0, r.stderr
    assert affinity(tmp_path, 1)[0] == {"cores": [CORES[-1]], "omp": "1"}


def test_bad_bindings_stop_before_any_rank(tmp_path):
    body = script(tmp_path, AFFINITY)
    r = deepspeed(
        tmp_path, "--num_gpus", "3", "--bind_cores_to_rank", "--bind_core_list", "0-1", body
    )
    assert r.returncode == 1
    assert "2 core(s) for 3 rank(s): each rank needs at least one" in r.stderr
    r = deepspeed(
        tmp_path, "--num_gpus", "1", "--bind_cores_to_rank", "--bind_core_list", "3-1", body
    )
    assert r.returncode == 1 and "core range '3-1'" in r.stderr
    r = deepspeed(tmp_path, "--num_gpus", "1", "--bind_core_list", "0", body)
    assert r.returncode == 1 and "--bind_core_list only goes with --bind_cores_to_rank" in r.stderr
    assert not list(tmp_path.glob("aff_*.json"))


def test_range_lists():
    assert face.parse_range_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert list(face.parse_range("5")) == [5]
    for bad in ("3-1", "a", "-2", "1,1", "4,2"):
        with pytest.raises(ValueError, match="core"):
            numa.parse_range_list(bad)
    assert numa.format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert numa.cores_for_rank("0-7", 3, 2) == (2, [4, 5])  # 2 each; cores 6, 7 unused


def test_numactl_command_binds_memory_to_the_cores_node(monkeypatch):
    monkeypatch.setattr(numa, "check_for_numactl_pkg", lambda: True)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert numa.get_numactl_cmd("0-7", 2, 1) == (4, ["numactl", "-m", "1", "-C", "4-7"])
    # flat HBM: memory-only nodes paired with the core nodes are preferred
    monkeypatch.setattr(numa, "get_numa_cores", lambda: [[0, 1], [2, 3], [], []])
    assert numa.get_numactl_cmd("0-3", 2, 1) == (2, ["numactl", "-p", "3", "-C", "2-3"])
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="KMP_AFFINITY is set"):
        numa.get_numactl_cmd("0-3", 2, 0)


def test_numa_nodes_are_read_from_sys():
    nodes = numa.get_numa_cores()
    if nodes:  # every core this process may use sits on some node
        assert set(CORES) <= {c for node in nodes for c in node}

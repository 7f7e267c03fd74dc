"""The process topology against upstream's rank formula, rank = (pipe*d + data)*t + model
(tensor ranks consecutive, then data, then pipe), for every 3D shape of 8 ranks."""

from __future__ import annotations

import itertools

import pytest

from deepspeed_ext.comm import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from deepspeed_ext.comm.topology import default_pipe_data_topology

SHAPES_8 = [(p, d, t) for p, d, t in itertools.product([1, 2, 4, 8], repeat=3) if p * d * t == 8]


def formula_groups(p: int, d: int, t: int) -> dict[str, list[list[int]]]:
    """Groups along each axis, written straight from the formula."""

    def rank(i: int, j: int, k: int) -> int:
        return (i * d + j) * t + k

    return {
        "model": [[rank(i, j, k) for k in range(t)] for i in range(p) for j in range(d)],
        "data": [[rank(i, j, k) for j in range(d)] for i in range(p) for k in range(t)],
        "pipe": [[rank(i, j, k) for i in range(p)] for j in range(d) for k in range(t)],
    }


@pytest.mark.parametrize("p,d,t", SHAPES_8)
def test_3d_groups_follow_upstream_formula(p, d, t):
    topo = PipeModelDataParallelTopology(num_pp=p, num_mp=t, num_dp=d)
    assert topo.world_size() == 8
    want = formula_groups(p, d, t)
    for axis in ("model", "data", "pipe"):
        got = topo.get_axis_comm_lists(axis)
        assert sorted(map(sorted, got)) == sorted(map(sorted, want[axis])), axis
        for g in got:  # each list in coordinate order along the axis
            assert [getattr(topo.get_coord(r), axis) for r in g] == list(range(len(g)))
    for r in range(8):
        c = topo.get_coord(r)
        assert (c.pipe * d + c.data) * t + c.model == r
        assert topo.get_rank(pipe=c.pipe, data=c.data, model=c.model) == r
    # every rank with one data coordinate is one replica's model-parallel group
    for j in range(d):
        assert topo.get_axis_list("data", j) == sorted(
            (i * d + j) * t + k for i in range(p) for k in range(t)
        )
    with pytest.raises(ValueError, match="unknown axis 'expert'"):  # as upstream's
        topo.get_axis_list("expert", 0)
    assert topo.get_axis_comm_lists("expert") == []


def test_pipe_data_topology_and_queries():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=4)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.get_dim("model") == 0
    assert topo.filter_match(pipe=1) == [4, 5, 6, 7]
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.filter_match(pipe=0, data=1) == [2, 3]
    assert three.get_rank_repr(3) == "model_01"
    assert three.get_rank_repr(3, omit_axes=[]) == "pipe_00-data_01-model_01"


def test_default_grid_topology_deals_prime_factors():
    assert default_pipe_data_topology(8).dims == [4, 2]
    assert default_pipe_data_topology(12).dims == [6, 2]
    assert default_pipe_data_topology(1).dims == [1, 1]


def test_bad_topologies_name_the_problem():
    with pytest.raises(ValueError, match="dims"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(["a"], [0])
    topo = ProcessTopology(["a", "b"], [2, 3])
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(a=0)
    with pytest.raises(ValueError, match="unknown axes"):
        topo.filter_match(c=1)

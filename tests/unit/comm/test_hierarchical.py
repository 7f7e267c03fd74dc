"""The hierarchical all-reduce ([Note: hierarchical all-reduce]) on real gloo ranks, 4 ranks
as 2 nodes of 2: the node groups, sums equal to the flat all-reduce's (integer-valued, so any
order is exact), the flat one where the layout has no nodes to exploit, and an engine whose
training matches the flat one, at stage 0 and with ZeRO's two-step reduce-scatter
([Note: hierarchical reduce-scatter]); combinations that cannot work are refused by name."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.config import ConfigError, parse
from tests.helpers.distributed import run_ranks

from . import hierarchical_runs as runs


def test_node_groups_and_sums_equal_to_the_flat_all_reduce() -> None:
    outs = run_ranks(runs.sums, 4, 2, timeout=120)
    assert [o["groups"][:2] + o["groups"][3:] for o in outs] == [
        ((0, 1), (0, 2), 2),
        ((0, 1), (1, 3), 2),
        ((2, 3), (0, 2), 2),
        ((2, 3), (1, 3), 2),
    ]
    for o in outs:
        assert o["equal"] == [True] * 10
        assert o["scatter_equal"] == [True] * 8


@pytest.mark.parametrize("per_node", [2, 3])
def test_sums_with_unequal_node_and_rank_counts(per_node: int) -> None:
    """6 ranks as 3 nodes of 2 and 2 nodes of 3: a mix-up of the node count and the ranks a
    node (equal at 2 x 2) shows; 3 pieces pad a ragged all-reduce segment differently."""
    for o in run_ranks(runs.sums, 6, per_node, timeout=180):
        assert o["groups"] is not None and o["groups"][3] == per_node, o
        assert o["equal"] == [True] * 10 and o["scatter_equal"] == [True] * 8, o


@pytest.mark.parametrize(
    ("world", "per_node", "why"), [(2, 2, "on one node"), (3, 2, "different numbers")]
)
def test_the_flat_all_reduce_where_there_are_no_even_nodes(
    world: int, per_node: int, why: str
) -> None:
    for o in run_ranks(runs.sums, world, per_node, timeout=120):
        assert o["groups"] is None and why in o["why"], o


def test_an_engine_trains_as_with_the_flat_all_reduce() -> None:
    for o in run_ranks(runs.engines, 4, timeout=240):
        assert o["hierarchical_uses_nodes"] and not o["flat_uses_nodes"]
        for n, p in o["flat"].items():
            torch.testing.assert_close(o["hierarchical"][n], p, rtol=1e-6, atol=1e-7)


def test_zero_reduce_scatters_in_two_steps_and_trains_as_flat() -> None:
    """[Note: hierarchical reduce-scatter]: stages 2 and 3, 4 ranks as 2 nodes of 2."""
    for o in run_ranks(runs.zero_engines, 4, timeout=300):
        for stage in (2, 3):
            two_step, flat = "reduce_scatter_bucket_hierarchical", "reduce_scatter_bucket"
            hier, plain = o[f"{stage}_hierarchical_counts"], o[f"{stage}_flat_counts"]
            assert hier[two_step] > 0 and hier[flat] == 0, hier
            assert plain[flat] > 0 and plain[two_step] == 0, plain
            for n, p in o[f"{stage}_flat"].items():
                torch.testing.assert_close(o[f"{stage}_hierarchical"][n], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"zero_optimization": {"stage": 2, "reduce_scatter": False}},
            "reduce_scatter false asks for a flat all-reduce",
        ),
        ({"gradient_compression": {"algorithm": "1bit"}}, "both replace the gradient all-reduce"),
        ({"communication": {"topology": "hierarchical", "ranks_per_node": 0}}, "ranks_per_node"),
        ({"communication": {"topology": "ring"}}, "communication.topology"),
    ],
)
def test_combinations_that_cannot_work_are_refused(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"communication": {"topology": "hierarchical"}, **extra})


def test_ranks_per_node_without_the_hierarchy_is_refused() -> None:
    with pytest.raises(ConfigError, match="ranks_per_node applies with communication.topology"):
        parse({"communication": {"ranks_per_node": 2}})


def test_slow_node_keys_are_checked_before_anything_runs() -> None:
    """[Note: slow nodes]: an interval alone would do nothing; a tolerance must be > 0."""
    with pytest.raises(ConfigError, match="slow_node_interval applies with"):
        parse({"communication": {"slow_node_interval": 10}})
    with pytest.raises(ConfigError, match="slow_node_tolerance: expected a value greater than 0"):
        parse({"communication": {"slow_node_tolerance": 0}})
    c = parse({"communication": {"slow_node_tolerance": 0.2}}).communication
    assert (c.slow_node_tolerance, c.slow_node_interval) == (0.2, None)  # None: every 50 steps
    assert parse(parse({"communication": {"slow_node_tolerance": 0.2}}).to_dict())

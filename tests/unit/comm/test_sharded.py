"""ZeRO's bucket collectives on gloo ranks ([Note: in-place collectives on gloo], [Note:
reduce-scatter by exchange]): the reduce-scatter as pairwise exchanges and the all-gather as
per-rank broadcasts give the exact sums and chunks, over the world and over a subgroup whose
group ranks are not its global ranks, with several exchanges in flight and big buckets cut into
pieces through a bounded scratch."""

from __future__ import annotations

from tests.helpers.distributed import run_ranks
from tests.unit.comm.sharded_runs import exchanges

# bytes: 16 fp32 columns a piece; whole up to 64 elements from peers; 2 such in flight
PIECE, WHOLE, BUDGET = 64, 256, 512


def test_exchange_and_broadcast_collectives_on_3_ranks():
    sizes = [1, 5, 31, 32, 33, 200, 1000]  # chunk elements: whole, then more and more pieces
    results = run_ranks(exchanges, 3, sizes, PIECE, WHOLE, BUDGET, timeout=240)
    for rank, out in enumerate(results):
        assert out["errors"] == [], (rank, out["errors"])
        for w, n, scratch in out["scratch"]:  # fp32: 4 bytes an element
            if (w - 1) * n * 4 <= WHOLE:  # received whole, in the background
                assert scratch == (w - 1) * n * 4, (w, n, scratch)
            else:  # two pieces of at most PIECE from each peer in flight
                assert scratch == 2 * (w - 1) * PIECE, (w, n, scratch)
        # the budget completed older exchanges instead of holding more scratch
        assert max(out["in_flight"]) <= BUDGET < sum(s for *_, s in out["scratch"][:7])
    assert results[0]["axis"] == (0, 2) and results[1]["axis"] is None
    # ranks that disagree on LOCAL_WORLD_SIZE (nodes of 2 and 1) all keep the all-reduce
    assert [out["pays"] for out in results] == [(True, False)] * 3


def test_exchange_only_where_no_node_sends_more_than_the_ring():
    """exchange.beats_ring: inside one node always; across nodes while a node of L of the W
    ranks sends L (W - L) chunks out against the all-reduce ring's 2 (W - 1)."""
    from deepspeed_ext.comm.exchange import beats_ring

    assert beats_ring((0, 1, 2, 3), 4)  # one node
    assert not beats_ring(tuple(range(8)), 4)  # 2 x 4: 16 chunks against 14
    assert beats_ring((0, 1, 2, 3), 2)  # 2 x 2: 4 against 6
    assert beats_ring((0, 4), 4)  # a hierarchical cross-node group: one rank a node
    assert beats_ring(tuple(range(8)), 0)  # no launcher's LOCAL_WORLD_SIZE: one node

"""deepspeed.comm (the user-facing face) against torch.distributed's semantics, on 2 real
gloo ranks: async_op wherever torch takes it (a completed handle on a group of one rank),
upstream's other names (group queries, all_to_all, the coalesced collectives, batched
point-to-point), and tensors that are not dense (a strided view, a transpose), which run on
a dense copy and land in the caller's tensor. One spawn serves every check."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import face_runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(face_runs.face_checks, 2, timeout=240)


def _rank(r: int, k: float) -> torch.Tensor:
    return torch.arange(8.0) + k * r


def test_all_gather_takes_async_op(runs: list[dict]) -> None:
    for r in runs:
        got = r["all_gather_async"]
        assert not isinstance(got, str), got
        assert [t.tolist() for t in got] == [[0.0, 0.0], [1.0, 1.0]]


def test_async_op_on_a_group_of_one_returns_a_completed_handle(runs: list[dict]) -> None:
    res = runs[0]["solo_async"]
    assert len(res) == 14
    for name, got in res.items():
        assert got == ("ok", True, [0.0, 1.0, 2.0]), (name, got)


def test_world_of_one_without_a_process_group_returns_completed_handles() -> None:
    import deepspeed.comm as dist

    x = torch.arange(3.0)
    for h in (
        dist.all_reduce(x, async_op=True),
        dist.broadcast(x, 0, async_op=True),
        dist.all_gather([torch.empty(3)], x, async_op=True),
        dist.reduce(x, 0, async_op=True),
    ):
        assert h.wait() and h.is_completed() and h.exception() is None
    assert dist.all_reduce(x) is None
    assert torch.equal(x, torch.arange(3.0))
    assert dist.get_all_ranks_from_group() == [0] and dist.get_global_rank() == 0


def test_group_queries(runs: list[dict]) -> None:
    for r in runs:
        assert r["get_global_rank_world"] == 1
        assert r["ranks_world"] == [0, 1]
        assert r["ranks_world_group"] == [0, 1]
        assert r["world_group_is_torchs"] is True
        assert r["flags"] == (True, True, True)
        assert r["import_comm_comm"] is True
    assert runs[1]["get_global_rank_g1"] == 1
    assert runs[1]["ranks_g1"] == [1]


@pytest.mark.parametrize("key", ["all_to_all", "all_to_all_async"])
def test_all_to_all(runs: list[dict], key: str) -> None:
    for me, r in enumerate(runs):
        got = r[key]
        assert not isinstance(got, str), got
        # rank i's input j is 10 i + j: output i is rank i's input `me`
        assert [t.tolist() for t in got] == [[10.0 * i + me] * 2 for i in range(2)]


@pytest.mark.parametrize("key", ["all_reduce_coalesced", "all_reduce_coalesced_async"])
def test_all_reduce_coalesced(runs: list[dict], key: str) -> None:
    want = [
        torch.full((2,), 1.0) + torch.full((2,), 2.0),
        torch.arange(3) * 1 + torch.arange(3) * 2,
        (torch.arange(8.0) * 1)[::2] + (torch.arange(8.0) * 2)[::2],
        torch.full((2, 2), 3.0),
    ]
    for r in runs:
        got = r[key]
        assert not isinstance(got, str), got
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


@pytest.mark.parametrize("key", ["all_gather_coalesced", "all_gather_coalesced_async"])
def test_all_gather_coalesced(runs: list[dict], key: str) -> None:
    for r in runs:
        got = r[key]
        assert not isinstance(got, str), got
        assert got[0].tolist() == [1.0, 1.0, 2.0, 2.0]
        assert got[1].tolist() == [5, 6]


def test_batch_isend_irecv(runs: list[dict]) -> None:
    for me, r in enumerate(runs):
        got = r["batch_isend_irecv"]
        assert not isinstance(got, str), got
        n, t = got
        assert n == 2 and t.tolist() == [7.0 + 1 - me] * 2


def test_p2p_op_takes_only_isend_or_irecv() -> None:
    import deepspeed.comm as dist

    with pytest.raises(ValueError, match="isend or irecv"):
        dist.P2POp(dist.send, torch.zeros(1), 0)


@pytest.mark.parametrize("key", ["all_reduce_strided", "all_reduce_strided_async"])
def test_all_reduce_of_a_strided_view(runs: list[dict], key: str) -> None:
    dense_sum = _rank(0, 1.0)[::2] + _rank(1, 1.0)[::2]
    for me, r in enumerate(runs):
        got = r[key]
        assert not isinstance(got, str), got
        assert torch.equal(got[::2], dense_sum)
        assert torch.equal(got[1::2], _rank(me, 1.0)[1::2])  # the rest of the base untouched


@pytest.mark.parametrize("key", ["all_reduce_transposed", "all_reduce_transposed_async"])
def test_all_reduce_of_a_transpose(runs: list[dict], key: str) -> None:
    want = (torch.arange(6.0).view(2, 3) * 2 + 1).t()
    for r in runs:
        got = r[key]
        assert not isinstance(got, str), got
        assert torch.equal(got, want)


def test_broadcast_reduce_and_inference_all_reduce_of_views(runs: list[dict]) -> None:
    for me, r in enumerate(runs):
        b = r["broadcast_strided"]
        assert not isinstance(b, str), b
        assert torch.equal(b[::2], _rank(1, 10.0)[::2])
        assert torch.equal(b[1::2], _rank(me, 10.0)[1::2])
        x = r["inference_all_reduce_strided"]
        assert not isinstance(x, str), x
        assert torch.equal(x, (torch.arange(6.0).view(2, 3) * 2 + 1)[:, ::2])
    red = runs[0]["reduce_strided"]
    assert not isinstance(red, str), red
    assert torch.equal(red[1::2], _rank(0, 1.0)[1::2] + _rank(1, 1.0)[1::2])
    assert torch.equal(red[::2], _rank(0, 1.0)[::2])


def test_all_gather_of_a_strided_input(runs: list[dict]) -> None:
    for r in runs:
        got = r["all_gather_strided_input"]
        assert not isinstance(got, str), got
        assert [t.tolist() for t in got] == [_rank(i, 1.0)[::2].tolist() for i in range(2)]

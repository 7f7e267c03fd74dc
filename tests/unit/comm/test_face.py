"""deepspeed.comm (the user-facing face) against torch.distributed's semantics, on 2 real
gloo ranks: async_op wherever torch takes it (a completed handle on a group of one rank),
and tensors that are not dense (a strided view, a transpose), which run on a dense copy and
land in the caller's tensor. One spawn serves every check."""

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
    assert len(res) == 11
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

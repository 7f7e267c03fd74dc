"""Partitioned pipeline p2p ([Note: partitioned p2p]) on 4 real gloo ranks: 2 stages x 2
tensor ranks. The engine's use of it (pipeline.pipe_partitioned / grad_partitioned under
tensor slicing) is trained against one process in tests/unit/tp/test_3d.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import p2p_runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(p2p_runs.channels, 4, timeout=300)


def test_split_and_whole_channels_deliver_the_same_tensors(runs: list[dict]) -> None:
    for r in runs:
        if r["stage"] != 1:
            continue
        for tag in (1, 2):
            assert len(r[f"got_{tag}"]) == len(r["expected"])
            for got, want in zip(r[f"got_{tag}"], r["expected"], strict=True):
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype and g.shape == w.shape
                    assert torch.equal(g, w.detach())


def test_a_split_sender_puts_half_the_bytes_on_the_link(runs: list[dict]) -> None:
    for r in runs:
        if r["stage"] == 0:
            whole, split = r["sent"][1], r["sent"][2]
            # each part is half the payload, padded to 16 bytes, plus the 16-byte header
            # and the negotiation messages both channels send alike
            assert 0.4 < split / whole < 0.7, r["sent"]


@pytest.mark.parametrize(
    "case, why",
    [("values", "tensor 0's values"), ("shapes", "shapes"), ("nan", "not finite on one rank")],
)
def test_tensor_ranks_that_disagree_fail_on_every_rank(
    runs: list[dict], case: str, why: str
) -> None:
    for r in runs:
        msg = r[case]
        if r["stage"] == 0:
            assert msg is not None and msg.startswith("ValueError"), msg
            assert "pipe_partitioned" in msg and why in msg, msg
        else:
            assert msg is not None and msg.startswith("PipeAborted"), msg


def test_tensor_ranks_that_differ_by_rounding_pass(runs: list[dict]) -> None:
    for r in runs:
        assert r["rounding"] is None, r["rounding"]
        if r["stage"] == 1:
            got, ids = r["rounded"]
            torch.testing.assert_close(got, r["base"], rtol=1e-5, atol=0)
            assert torch.equal(ids, torch.arange(3))


def test_one_failed_sender_fails_every_receiver(runs: list[dict]) -> None:
    """Tensor rank 0 of the sending stage aborts, rank 1 sends: both receivers raise (the
    one whose own sender was fine would otherwise wait in the gather for the other part)."""
    for r in runs:
        if r["stage"] == 1:
            assert r["abort"] is not None and r["abort"].startswith("PipeAborted"), r["abort"]
        else:
            assert r["abort"] is None, r["abort"]


def test_early_receives_land_without_overwriting_held_messages(runs: list[dict]) -> None:
    """[Note: pipeline p2p]: each receive but the last posts the next one's; what lands
    early is the right message, a shape change included, and the previous slot's tensors
    are untouched by it. An abort that lands early raises."""
    shapes = [3, 3, 3, 3, 6]
    for r in runs:
        if r["stage"] != 1:
            continue
        assert r["early_posted"] == [True, True, True, True, False]
        assert all(r["early_intact"]), r["early_intact"]
        for step, (got, rows) in enumerate(zip(r["early_got"], shapes, strict=True)):
            for g, w in zip(got, p2p_runs._tensors(step, rows), strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w.detach())
        assert r["early_abort"] is not None and r["early_abort"].startswith("PipeAborted")


def test_a_split_channel_carries_empty_messages(runs: list[dict]) -> None:
    for r in runs:
        if r["stage"] == 1:
            assert r["empty"] == [(), ()], r["empty"]

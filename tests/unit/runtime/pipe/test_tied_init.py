"""Tied weights start from the copy of the key's first layer, as the plain model builds it,
whichever stage holds that layer: under DualPipeV's V and under interleaving it is not the
lowest stage (both once started from a later layer's seed)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import tied_init_runs as tr


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "dualpipev"])
def test_tied_weights_start_as_the_plain_model_builds_them(schedule: str) -> None:
    want = tr.plain()
    for out in run_ranks(tr.built, 2, schedule, timeout=120):
        torch.testing.assert_close(out["tied"], want["tied"], rtol=0, atol=0)
        assert out["loss"] == pytest.approx(want["loss"], rel=1e-5)

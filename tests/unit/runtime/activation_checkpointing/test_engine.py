"""deepspeed.checkpointing under the engine on 2 ranks: every ZeRO stage trains exactly as
without checkpointing (fp32, dropout replayed), and the config's activation_checkpointing
section reaches deepspeed.checkpointing."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks

from .engine_runs import hf_zero3_checkpointing, modes_match


def test_every_zero_stage_matches_no_checkpointing_on_two_ranks():
    for r in run_ranks(modes_match, 2, [0, 1, 2, 3], timeout=300):
        metrics = r.pop("metrics")
        assert metrics["ckpt_forward_ms"] > 0 and metrics["ckpt_recompute_ms"] > 0, metrics
        for key, v in r.items():
            assert v["losses_equal"] and v["params_equal"], (key, v)
            assert v["cpu_setting"] == key.endswith("cpu"), key


def test_hugging_face_gradient_checkpointing_under_zero3():
    pytest.importorskip("transformers")
    for r in run_ranks(hf_zero3_checkpointing, 2, timeout=300):
        assert r == {"reentrant": True, "non_reentrant": True}, r

"""A plain loop under Accelerate's DeepSpeedPlugin (ZeRO 2), unmodified, on 2 CPU ranks through
our launcher (examples/hf_accelerate.py): the loss falls, the gradient norm comes back from the
engine, save_state writes the engine's checkpoint and get_state_dict the full weights."""

from __future__ import annotations

import json
import math

import pytest

from .runs import Runs, hf_missing

if (why := hf_missing()) is not None:
    pytest.skip(why, allow_module_level=True)


def _printed(log: str, key: str) -> list[float]:
    line = next(ln for ln in log.splitlines() if key + " " in ln)
    return json.loads(line.split(key + " ", 1)[1])


def test_accelerate_deepspeed_plugin_zero2_trains(tmp_path):
    run = Runs(tmp_path).get("acc", "--steps", "8", script="hf_accelerate.py")
    losses, norms = _printed(run.log, "LOSSES"), _printed(run.log, "GRAD_NORMS")
    assert len(losses) == len(norms) == 8
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(math.isfinite(n) and n > 0 for n in norms), norms
    ckpt = run.out / "state" / "pytorch_model"
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert (run.out / "final" / "model.safetensors").is_file()

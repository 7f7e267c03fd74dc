"""1-bit LAMB ([Note: 1-bit LAMB]) on real gloo ranks: this package's LAMB bit for bit during
the warm-up, the gradient all-reduce off after it, one model on every rank, trust ratios
from the warm-up's running average, and a resume that continues bit for bit. Its loss
against LAMB's: test_onebit_adam.py::test_a_tiny_gpt_learns_as_with_adam."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepspeed_ext.config import ConfigError, parse
from deepspeed_ext.ops.lamb import FusedLamb
from deepspeed_ext.runtime.onebit.lamb import OnebitLamb
from tests.helpers.distributed import run_ranks

from . import onebit_runs as runs
from .parity import same_steps


def test_the_warm_up_is_lamb_bit_for_bit_alone() -> None:
    def same_coeffs(ref: FusedLamb, bit: OnebitLamb) -> None:
        assert bit.get_lamb_coeffs() == ref.get_lamb_coeffs()

    same_steps(
        lambda ps: FusedLamb(ps, lr=3e-3, weight_decay=0.1),
        lambda ps: OnebitLamb(ps, lr=3e-3, weight_decay=0.1, freeze_step=10),
        each=same_coeffs,
    )


def test_warm_up_switch_one_model_and_an_exact_resume(tmp_path: Path) -> None:
    r0, r1 = run_ranks(runs.onebit_lamb_runs, 2, str(tmp_path), timeout=240)
    for n in r0["lamb"]:
        assert torch.equal(r0["warm"][n], r0["lamb"][n]), n  # freeze_step not reached
    assert r0["allreduce"] == [True] * 3 + [False] * 5  # freeze_step 3
    # compressing: the momenta's all-to-all and all-gather (the all-reduce is the norm's)
    assert "all_to_all_single" in r0["rows"], r0["rows"]
    for n in r0["bit"]:
        assert torch.equal(r0["bit"][n], r1["bit"][n]), n
    # the trust ratios: the warm-up's running average (from 0, coeff_beta 0.9, 3 steps)
    # times factors within [0.5, 4]
    assert len(r0["coeffs"]) == 6 and all(0 < c < 10 * (1 - 0.9**3) * 4 for c in r0["coeffs"])
    for r in (r0, r1):
        for n in r["straight"]:
            assert torch.equal(r["resumed"][n], r["straight"][n]), n


def test_bad_values_name_the_parameter() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.stage 0 only .*it is 2"):
        parse({"optimizer": {"type": "OneBitLamb"}, "zero_optimization": {"stage": 2}})
    params = list(torch.nn.Linear(2, 2).parameters())
    for kwargs, message in (
        ({"factor_min": 2.0}, "factor_min=2.0, factor_max=4.0"),
        ({"coeff_beta": 1.0}, "coeff_beta=1.0"),
        ({"min_coeff": 20.0}, "min_coeff=20.0, max_coeff=10.0"),
        ({"factor_threshold": -0.1}, "factor_threshold=-0.1"),
        ({"freeze_step": 0}, "freeze_step=0 must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            OnebitLamb(params, **kwargs)

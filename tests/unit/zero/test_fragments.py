"""[Note: param fragments]: deepspeed.utils.safe_get/set_* at ZeRO stages 0-3 on two ranks,
against a single-process reference (the mean gradient of the two ranks' batches, AdamW's
first moment after one step), and the ranks' local parts against the whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import mean_grads, mlp

from . import fragment_runs as fr


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return {n: p.detach() for n, p in mlp().named_parameters()}, mean_grads(2)


@pytest.mark.parametrize(
    ("stage", "bf16", "nvme"),
    [(0, False, False), (1, False, False), (2, True, False), (3, False, False), (3, False, True)],
    ids=["0", "1", "2-bf16", "3", "3-nvme"],  # nvme: masters and state swapped in to be read
)
def test_fragments_match_the_reference(stage: int, bf16: bool, nvme: bool, tmp_path):
    where = str(tmp_path) if nvme else None
    outs: list[dict[str, Any]] = run_ranks(fr.fragments, 2, stage, bf16, where, timeout=180)
    params, grads = _reference()
    tol = {"rtol": 2e-2, "atol": 2e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    for out in outs:
        assert out["frozen"] is None
        assert "momentum_buffer" in out["no such state"]
        for n in fr.NAMES:
            torch.testing.assert_close(out[f"grad {n}"], grads[n], **tol, msg=n)
            torch.testing.assert_close(out[f"param {n}"], params[n], **tol, msg=n)
            # AdamW's first moment after one step: (1 - beta1) * grad
            torch.testing.assert_close(out[f"exp_avg {n}"], 0.1 * out[f"grad {n}"], msg=n)
        torch.testing.assert_close(out["set param"], torch.full((4,), 0.25))
        torch.testing.assert_close(out["model param"], torch.full((4,), 0.25))
    for n in fr.NAMES:
        for kind in ("grad", "param"):
            local = torch.cat([o[f"local {kind} {n}"].reshape(-1) for o in outs])
            whole = outs[0][f"{kind} {n}"].reshape(-1)
            if stage == 0:  # not partitioned: each rank holds it all
                local = outs[0][f"local {kind} {n}"].reshape(-1)
            torch.testing.assert_close(local, whole, msg=f"{kind} {n}")


def test_a_param_of_no_engine_is_refused():
    from deepspeed.utils import safe_get_full_fp32_param

    with pytest.raises(ValueError, match="not trained by a deepspeed engine"):
        safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))

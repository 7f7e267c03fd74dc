"""Pipeline parity on real gloo ranks: per-step losses and final weights of 2 stages x 2
data-parallel and 4 stages x 1, at ZeRO 0/1/2, under 1F1B, interleaving, ZB-H1 and DualPipeV,
equal a single-process torch run on the same global batches (fp32); bf16 runs track it within
bf16's precision. The model ties its input embedding to the output head across the first and
last stages (under DualPipeV both are on stage 0)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import pipe_runs as pr

STEPS, GAS = 3, 4
CASES = [
    (2, 0, "fp32"),
    (2, 1, "fp32"),
    (2, 2, "fp32"),
    (4, 0, "fp32"),
    (4, 1, "fp32"),
    (4, 2, "fp32"),
    (2, 2, "bf16"),
    (4, 1, "bf16"),
    (2, 1, "fp32", 2),  # interleaved: 2 model chunks per rank (4 virtual stages)
    (2, 0, "fp32", 3),
    (2, 2, "bf16", 2),
    (2, 0, "fp32", "zb-h1"),  # zero bubble: backward split into B and W
    (4, 2, "fp32", "zb-h1"),
    (4, 1, "bf16", "zb-h1"),
    # DualPipeV: 2 stages per rank as a V, the loss on stage 0; 4 ranks need 2 * 4
    # micro-batches and 8 layers
    (2, 0, "fp32", "dualpipev"),
    (2, 2, "fp32", "dualpipev"),
    (2, 1, "bf16", "dualpipev"),
    (4, 1, "fp32", "dualpipev", {"gas": 8, "blocks": 6}),
    (2, 2, "fp32", "dualpipev-zb"),  # each backward split, W after the input gradients go
    (4, 1, "fp32", "dualpipev-zb", {"gas": 8, "blocks": 6}),
]


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return run_ranks(pr.pipeline_cases, 4, CASES, STEPS, GAS, timeout=400)


def _ref_name(name: str) -> str:
    if name.startswith("tied_modules.embed."):
        return "embed." + name[len("tied_modules.embed.") :]
    return "layers." + name


def _id(c: tuple) -> str:
    extra = "" if len(c) < 4 else f"-{c[3]}" if isinstance(c[3], str) else f"-v{c[3]}"
    return f"pp{c[0]}-zero{c[1]}-{c[2]}" + extra


def _chunks(c: tuple) -> int:
    if len(c) > 3 and str(c[3]).startswith("dualpipev"):
        return 2
    return c[3] if len(c) > 3 and isinstance(c[3], int) else 1


def _over(c: tuple) -> dict[str, int]:
    return {"gas": GAS, "blocks": pr.BLOCKS, **(c[4] if len(c) > 4 else {})}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_matches_single_process(runs: list[list[dict]], case: int) -> None:
    stages, _, dtype = CASES[case][:3]
    dp = 4 // stages
    gas, blocks = _over(CASES[case])["gas"], _over(CASES[case])["blocks"]
    ref_model = pr.Reference(blocks=blocks)
    ref = pr.reference(STEPS, gas, dp, blocks=blocks)
    ref_weights = dict(zip([n for n, _ in ref_model.named_parameters()], ref["params"]))
    per_rank = [r[case] for r in runs]
    tol = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=3e-2, atol=3e-2)}[dtype]
    for r in per_rank:  # every rank returns the same loss: the batch mean over data ranks
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), **tol)
        # the last stage's additional loss, on every stage ([Note: additional losses])
        torch.testing.assert_close(torch.tensor(r["aux"]), torch.tensor(ref["aux"]), **tol)
        # upstream's: this replica's mean on every stage; the last stage's micro-batch sum
        own = torch.tensor([sums[r["dp"]] / gas for sums in ref["sums"]])
        torch.testing.assert_close(torch.tensor(r["dp_group_loss"]), own, **tol)
        v = _chunks(CASES[case]) == 2 and isinstance(CASES[case][3], str)
        assert r["loss_stage"] == (r["stage"] == (0 if v else stages - 1))
        if r["loss_stage"]:
            sums = torch.tensor([s[r["dp"]] for s in ref["sums"]])
            torch.testing.assert_close(torch.tensor(r["total_loss"]), sums, **tol)
        else:
            assert r["total_loss"] == [None] * STEPS
    seen = set()
    for r in per_rank:
        assert len(r["parts"]) == stages * _chunks(CASES[case]) + 1
        want = CASES[case][3] if len(CASES[case]) > 3 and isinstance(CASES[case][3], str) else None
        if want is not None:
            assert (r["schedule"], r["unsplit"]) == (want, 0)  # every backward was split
        for name, w in r["weights"].items():
            torch.testing.assert_close(w, ref_weights[_ref_name(name)], **tol, msg=name)
            seen.add(_ref_name(name))
    assert seen == set(ref_weights), "every parameter lives on some stage"


def test_receives_are_posted_early_and_none_outlive_a_batch(runs: list[list[dict]]) -> None:
    """Every receiving channel posted each batch's receives but the first early, and none
    is left posted after the batch ([Note: pipeline p2p])."""
    for case in range(len(CASES)):
        chans = [e for r in runs for e in r[case]["early"]]
        assert chans, CASES[case]
        for posted, left in chans:
            assert not left, CASES[case]
            assert posted == STEPS * (_over(CASES[case])["gas"] - 1), CASES[case]


def test_tied_copies_stay_equal(runs: list[list[dict]]) -> None:
    for case, (stages, *_) in enumerate(CASES):
        name = "tied_modules.embed.weight"
        copies = [r[case]["weights"][name] for r in runs if name in r[case]["weights"]]
        # on the first and last stages of each replica; DualPipeV's are both stage 0
        v = _chunks(CASES[case]) == 2 and isinstance(CASES[case][3], str)
        assert len(copies) == (4 // stages) * (1 if v else 2)
        for c in copies[1:]:
            torch.testing.assert_close(c, copies[0], rtol=0, atol=0)


def test_additional_losses_over_a_changing_schedule() -> None:
    """2 stages x 2 data ranks, get_additional_losses on the last stage as planned_losses
    returns them: each step's values on every rank are the mean over the micro-batches (a
    name missing from one counts 0, as upstream) and the data ranks, by name whatever order
    the ranks return them in; names on one data rank only raise on every rank."""

    def expected(step: int) -> dict[str, Any] | None:
        sums: dict[str, torch.Tensor] = {}
        for dp in (0, 1):
            for mb in (0, 1):
                for k, v in (pr.planned_losses(step, dp, mb) or {}).items():
                    sums[k] = sums.get(k, torch.zeros_like(v)) + v / 4
        return {k: sums[k].tolist() for k in sorted(sums)} or None

    for r in run_ranks(pr.additional_losses_schedule, 4, timeout=300):
        assert r["eval_left_totals"]
        assert r["agg"] == [expected(s) for s in range(6)], r["agg"]
        step, message = r["error"]
        assert step == 6 and "data-parallel ranks returned different names" in message

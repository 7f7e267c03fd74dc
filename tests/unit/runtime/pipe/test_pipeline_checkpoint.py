"""Pipeline checkpoints: upstream's per-layer layout; a resume at the same layout continues
exactly as the uninterrupted run; a resume at 4 stages x 1 and at 1 stage x 4 data ranks
(from 2 stages x 2 data ranks, the global batch kept), and between 1F1B and DualPipeV,
continues as the single-process reference does, optimizer state included (re-cut by
parameter name)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import pipe_ckpt_runs as pc
from . import pipe_runs as pr

CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (1, "bf16")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    root = tmp_path_factory.mktemp("pipe_ckpt")
    return run_ranks(pc.all_cases, 4, str(root), CASES, timeout=400)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"zero{z}-{d}" for z, d in CASES])
def test_resume(runs: list[list[dict]], case: int) -> None:
    zero, dtype = CASES[case]
    tol = 1e-5 if dtype == "fp32" else 3e-2
    ref = pr.reference(4, pc.GAS, 2, warmup=3)["losses"]
    for r in (x[case] for x in runs):
        got = torch.tensor(r["losses"] + r["continued"])
        torch.testing.assert_close(got, torch.tensor(ref), rtol=tol, atol=tol)
        # same layout: bit-for-bit the uninterrupted run
        assert r["same_layout"] == r["continued"]
        for moved in ("four_stages", "four_data_ranks", "other_cut"):
            torch.testing.assert_close(
                torch.tensor(r[moved]), torch.tensor(ref[2:]), rtol=tol, atol=tol, msg=moved
            )
        assert r["client"] == {"note": "hi"}
        assert r["steps"] == (4, 4)


def test_dualpipev_checkpoints_resume_and_change_layout(runs: list[list[dict]]) -> None:
    """A DualPipeV checkpoint (2 stages per rank as a V) resumes exactly under DualPipeV and
    as the reference under 1F1B; a 1F1B one resumes under DualPipeV; zero_to_fp32 reads it."""
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    ref = pr.reference(4, 4, 2, warmup=3)["losses"]
    for r in (x[-2] for x in runs):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref))
        assert r["same_layout"] == r["losses"][2:]
        for moved in ("to_1f1b", "from_1f1b"):
            torch.testing.assert_close(torch.tensor(r[moved]), torch.tensor(ref[2:]), msg=moved)
    sd = get_fp32_state_dict_from_zero_checkpoint(runs[0][-2]["where"])
    ref2 = pr.reference(2, 4, 2, warmup=3)
    want = dict(zip([n for n, _ in ref2["model"].named_parameters()], ref2["params"]))
    assert len(sd) == len(want)
    for name, t in sd.items():
        ref_name = (
            "embed." + name.split(".", 2)[2] if name.startswith("tied_") else "layers." + name
        )
        torch.testing.assert_close(t, want[ref_name], rtol=1e-5, atol=1e-5, msg=name)


def test_default_load_state_dir_loads_each_stages_layers(runs: list[list[dict]]) -> None:
    """Upstream's PipelineModule.load_state_dir, called on a fresh 2-stage module (other
    initial weights), gives every rank the weights saved (bf16: the layer files hold bf16
    weights, read into the fp32 module exactly)."""
    for r in (x[case] for x in runs for case in range(len(CASES))):
        differed, loaded = r["load_state_dir"]
        assert differed and loaded and all(loaded.values()), loaded


def test_upstreams_layer_file_names(runs: list[list[dict]]) -> None:
    """ckpt_prefix leaves the data axis out; a local layer index names its global layer."""
    for r in (x[0] for x in runs):
        prefix, listed, path, first_layer, stage = r["names"]
        assert prefix.endswith(f"global_step2/module-pipe_{stage:02d}"), prefix
        assert listed == [path] == [f"layer_{first_layer:02d}-model_states.pt"]
        assert (first_layer == 0) == (stage == 0)


def test_parallel_write_shares_each_stages_layer_files_out(runs: list[list[dict]]) -> None:
    """checkpoint.parallel_write.pipeline_stage: each data-parallel rank of a stage writes a
    share of its layer files (none twice, none left out), where without it data-parallel
    rank 0 writes them all; the files hold the same tensors either way."""
    by_stage: dict[int, dict[int, dict]] = {}
    for r in (x[-1] for x in runs):
        stage, dp = r["ids"]
        by_stage.setdefault(stage, {})[dp] = r
        assert r["same_files"] and r["same_tensors"]
    for stage, ranks in by_stage.items():
        alone = ranks[0]["False"]
        assert alone and ranks[1]["False"] == [], stage
        shares = [ranks[dp]["True"] for dp in (0, 1)]
        assert all(shares) and sorted(shares[0] + shares[1]) == alone, (stage, shares)


def test_upstream_file_layout(runs: list[list[dict]]) -> None:
    files = runs[0][1]["files"]  # ZeRO 1
    layers = [f for f in files if f.startswith("layer_")]
    # embed (0), 4 blocks, the final norm, the tied head (7 layers; the head saved as well)
    assert layers == [f"layer_{i:02d}-model_states.pt" for i in range(7)]
    assert "mp_rank_00_model_states.pt" in files and "mp_rank_01_model_states.pt" in files
    for dp in (0, 1):
        for mp in (0, 1):
            assert f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" in files


@pytest.mark.parametrize("case", [0, 2])
def test_zero_to_fp32_consolidates_the_pipeline(runs: list[list[dict]], case: int) -> None:
    """The fp32 weights at step 2 equal the reference's after 2 steps, by module name."""
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    zero, dtype = CASES[case]
    sd = get_fp32_state_dict_from_zero_checkpoint(runs[0][case]["where"])
    ref = pr.reference(2, pc.GAS, 2, warmup=3)
    names = [n for n, _ in ref["model"].named_parameters()]
    want = dict(zip(names, ref["params"]))
    assert len(sd) == len(want)  # the tied head is the embedding, once
    for name, t in sd.items():
        ref_name = (
            "embed." + name.split(".", 2)[2] if name.startswith("tied_") else "layers." + name
        )
        torch.testing.assert_close(t, want[ref_name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_frozen_stage_resumes_at_its_layout_and_at_another(runs: list[list[dict]]) -> None:
    for r in (x[len(CASES)] for x in runs):
        assert r["same_layout"] == r["continued"]
        torch.testing.assert_close(torch.tensor(r["four_stages"]), torch.tensor(r["continued"]))


def test_a_client_optimizers_groups_resume_at_its_layout_and_at_another(
    runs: list[list[dict]],
) -> None:
    close = torch.testing.assert_close
    for r in (x[len(CASES) + 1] for x in runs):
        assert "written for other optimizer param groups" in r["cross"], r["cross"]
        assert "load_optimizer_states=False" in r["cross"], r["cross"]
    for case, freeze in (("trained", None), ("frozen", pc._freeze_matrices)):
        ref = pr.reference(4, pc.GAS, 2, optimizer=pr.decay_groups, freeze=freeze)["losses"]
        for r in (x[len(CASES) + 1][case] for x in runs):
            got = torch.tensor(r["losses"] + r["continued"])
            close(got, torch.tensor(ref), rtol=1e-5, atol=1e-5, msg=case)
            assert r["same_layout"] == r["continued"], case
            close(torch.tensor(r["four_stages"]), torch.tensor(ref[2:]), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_saved_before_the_first_step_resumes_at_another_layout(
    runs: list[list[dict]],
) -> None:
    """Saved at step 0 (the optimizer holds no state yet) from 2 stages x 2 data ranks at
    ZeRO 1 and 2: at 4 stages and at 1 stage x 4 data ranks it trains as the reference from
    its start (it was refused as 'saved from another model')."""
    ref = pr.reference(2, pc.GAS, 2, warmup=3)["losses"]
    for r in (x[len(CASES) + 2] for x in runs):
        assert len(r) == 4, r
        for name, losses in r.items():
            assert isinstance(losses, list), (name, losses)
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5, msg=name
            )

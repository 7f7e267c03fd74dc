"""Full 3D on 8 real gloo ranks: tensor slicing 2 x pipeline 2 x data 2 (ZeRO 1) trains the
pipeline tests' tiny GPT exactly as one process does on the same global batches (AdamW,
clipping at the whole model's norm, the embedding tied to the head across stages), with
activations and gradients partitioned over the tensor ranks between stages (upstream's
pipe_partitioned / grad_partitioned, on by default; [Note: partitioned p2p]). On 4 ranks,
turning those keys off trains alike and sends twice the bytes between stages, and
checkpointed layers keep 1/tp of their saved inputs (partition_activations) and train alike."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.pipe import pipe_runs as pr
from tests.unit.runtime.pipe.test_pipeline_parity import _ref_name

from . import tp_runs

STEPS, GAS = 3, 2


def test_tp2_pp2_dp2_matches_one_process() -> None:
    out = run_ranks(tp_runs.pipeline_3d, 8, STEPS, GAS, 1, timeout=600)
    ref = pr.reference(STEPS, GAS, dp=2)
    names = [n for n, _ in pr.Reference().named_parameters()]
    ref_weights = dict(zip(names, ref["params"], strict=True))
    assert {r["coords"] for r in out} == {(s, d, t) for s in (0, 1) for d in (0, 1) for t in (0, 1)}
    seen = set()
    for r in out:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5
        )
        # the last stage's additional loss, counted once over its tensor ranks
        torch.testing.assert_close(
            torch.tensor(r["aux"]), torch.tensor(ref["aux"]), rtol=1e-5, atol=1e-5
        )
        assert any(n.endswith("up.weight") for n in r["sliced"]), r["sliced"]
        assert r["split"] and all(r["split"]), r["split"]
        stage = r["coords"][0]
        assert r["upstream_attrs"] == (stage, True, True, True, stage - 1, stage + 1, pr.MICRO)
        for name, w in r["weights"].items():
            torch.testing.assert_close(w, ref_weights[_ref_name(name)], rtol=1e-5, atol=1e-5)
            seen.add(_ref_name(name))
    assert seen == set(ref_weights)


def test_partitioned_pipe_keys_halve_the_bytes_between_stages() -> None:
    out = run_ranks(tp_runs.pipeline_split_vs_whole, 4, 2, GAS, timeout=600)
    for r in out:
        torch.testing.assert_close(
            torch.tensor(r["split"]["losses"]), torch.tensor(r["whole"]["losses"]), rtol=0, atol=0
        )
        split, whole = r["split"]["isend_bytes"], r["whole"]["isend_bytes"]
        # every rank sends (stage 0 activations, stage 1 gradients); the negotiation
        # messages and the 16-byte headers are not halved
        assert 0.45 < split / whole < 0.6, (split, whole)
    # checkpointed layers keeping half of each saved input train as without checkpoints
    for r in out:
        ckpt = r["partitioned_ckpt"]
        assert ckpt["interval"] == 1  # set by the config's pipeline key
        assert ckpt["parts"] > 0, ckpt  # saved inputs were split over the tensor ranks
        torch.testing.assert_close(
            torch.tensor(ckpt["losses"]), torch.tensor(r["split"]["losses"]), rtol=1e-6, atol=0
        )
    # stage 0 frozen over sliced layers: the rest trains as one process with those frozen
    n0 = out[0]["frozen_stage"]["frozen_layers"]

    def freeze(model: pr.Reference) -> None:
        for layer in list(model.layers)[:n0]:
            layer.requires_grad_(False)

    frozen_ref = pr.reference(2, GAS, 1, tied=False, freeze=freeze)["losses"]
    for r in out:
        torch.testing.assert_close(
            torch.tensor(r["frozen_stage"]["losses"]), torch.tensor(frozen_ref)
        )
    # DualPipeV's V over the same sliced stages, its p2p partitioned too
    ref = pr.reference(2, 4, 1)["losses"]
    for r in out:
        assert r["dualpipev"]["split"]
        torch.testing.assert_close(torch.tensor(r["dualpipev"]["losses"]), torch.tensor(ref))


@pytest.mark.parametrize("world, ok", [(64, True), (48, False)])
def test_a_guides_3d_config_is_checked_before_spawn(world: int, ok: bool) -> None:
    """The 3D example widely read guides print (ZeRO 3 + offload, 8 stages, tensor 4)."""
    from deepspeed_ext.config import ConfigError, validate_config_file

    guide = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 16,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "pipeline_parallelism": {"num_stages": 8},
        "tensor_model_parallel_size": 4,
    }
    if ok:
        validate_config_file(guide, world)
    else:
        with pytest.raises(ConfigError, match="not a multiple of the 32 ranks"):
            validate_config_file(guide, world)


def test_the_guides_3d_config_runs_shrunk() -> None:
    out = run_ranks(tp_runs.guide_3d_shrunk, 4, timeout=600)
    for r in out:
        assert r["stage"] == 2  # stage 3 under model parallelism runs as stage 2, and says so
        assert r["losses"][-1] < 0.9 * r["losses"][0], r["losses"]
        assert len(r["sliced"]) == 2 * 3  # each stage: 2 blocks x (up_proj w, b; down_proj w)


def test_a_3d_checkpoint_resumes_at_another_stage_count_and_consolidates(tmp_path) -> None:
    """TP 2 x PP 2 saved, TP 2 x PP 1 x DP 2 resumed: each rank reads its own tensor rank's
    files of every saved stage (it read model-parallel rank k as stage k: the other tensor
    rank's masters and optimizer state); zero_to_fp32 makes sliced weights whole (they came
    back half-size, stage 1 missing); another tensor-parallel size is refused by name."""
    out = run_ranks(tp_runs.restage_3d, 4, str(tmp_path), timeout=600)
    for r in out:
        assert r["loaded_err"] == 0.0, r
        assert r["export_err"] == 0.0, r
        assert r["export_names"] == r["loaded_names"], r
        assert abs(r["resumed"] - r["continued"]) < 1e-5, r
        assert "saved at tensor-parallel size 2 and this run has 1" in r["refused"], r

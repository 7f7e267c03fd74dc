"""Two-stage pipeline behaviour on real gloo ranks (pipe_scenarios.py runs them all in one
spawn): eval_batch, activation checkpointing, fp16 loss scaling across stages, the
pipeline_parallelism key, tuples with int masks, dynamic shapes, and failures that raise on
every rank (the failing stage's own error, PipeAborted on its neighbour) instead of hanging."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

from . import pipe_runs as pr
from . import pipe_scenarios as ps


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    out = run_ranks(ps.run_all, 2, timeout=300)
    for r in out:
        for name, v in r.items():
            assert "crashed" not in v, f"{name}:\n{v['crashed']}"
    assert set(out[0]) == set(ps.SCENARIOS)
    return out


def close(a: list[float], b: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=tol, atol=tol)


def test_eval_batch_matches_the_trained_reference(runs: list[dict]) -> None:
    ref = pr.reference(2, 2, 1)
    model = ref["model"].eval()
    data = pr.batches(99, 0, 3)
    with torch.no_grad():
        per_mb = [float(pr.lm_loss(model(ids), labels)) for ids, labels in data]
    for r in runs:
        close(r["eval"]["losses"], ref["losses"])
        assert r["eval"]["on_device"]
        close([r["eval"]["eval"]], [sum(per_mb) / 3])
        close([r["eval"]["eval2"]], [sum(per_mb[:2]) / 2])  # gas micro-batches by default
    assert runs[0]["eval"]["total_loss"] is None  # upstream's total_loss: the last stage's
    close([runs[1]["eval"]["total_loss"]], [sum(per_mb)])
    assert runs[0]["eval"]["logits"] is None  # logits live on the last stage
    assert runs[1]["eval"]["logits"] == [pr.MICRO, pr.SEQ, pr.VOCAB]


def test_tied_weights_come_with_a_torch_group_of_their_stages(runs: list[dict]) -> None:
    for r in runs:
        assert r["tied_groups"]["tied"] == [([pr.VOCAB, pr.DIM], 2, 2.0)]
        assert r["tied_groups"]["comms"] == {"embed": ([0, 1], ["weight"], True)}
        assert r["tied_groups"]["synced"]  # both stages hold stage 0's copy again


def test_upstreams_stage_p2p_calls(runs: list[dict]) -> None:
    first, last = runs[0]["stage_p2p"], runs[1]["stage_p2p"]
    assert last["got"] == [0.0, 1.0, 2.0] and first["got"] == [0.0, 10.0, 20.0]
    assert last["obj"] == {"from": 0, "shape": [2, 3]}
    assert "stage 0 cannot exchange with stage 0" in first["refused"] and first["can"]


def test_interleaved_train_and_eval(runs: list[dict]) -> None:
    ref = pr.reference(2, 2, 1)
    model = ref["model"].eval()
    with torch.no_grad():
        per_mb = [float(pr.lm_loss(model(ids), labels)) for ids, labels in pr.batches(99, 0, 3)]
    for r in runs:
        assert r["interleaved"]["schedule"] == "interleaved"
        close(r["interleaved"]["losses"], ref["losses"])
        close([r["interleaved"]["eval"]], [sum(per_mb) / 3])
        # 2 ranks x 2 chunks, gas 2 and an eval of 12: a buffer per micro-batch would be 12
        assert 1 <= r["interleaved"]["recv_buffers"] <= 3, r["interleaved"]["recv_buffers"]
    through = [r["interleaved"]["passed_through"] for r in runs]
    assert through[0] is None
    assert through[1] == [torch.full((2, 3), 2.0 * i).tolist() for i in range(3)]


def test_dualpipev_train_eval_config_key_and_dynamic_shapes(runs: list[dict]) -> None:
    ref = pr.reference(2, 4, 1)
    model = ref["model"].eval()
    with torch.no_grad():
        per_mb = [float(pr.lm_loss(model(ids), labels)) for ids, labels in pr.batches(99, 0, 3)]
    keyed_ref = ps.sequential_reference(2, 4)
    ragged_ref = pr.reference(2, 4, 1, data=lambda step, d, gas: ps._ragged(step, gas))
    for r in runs:
        d = r["dualpipev"]
        assert "gradient_accumulation_steps=3" in d["refused"], d["refused"]
        assert "at least 2 * num_stages = 4" in d["refused"]
        assert (
            "pipeline.schedule is 'zb-h1' but the model is a DualPipeVModule"
            in (d["other_schedule"])
        )
        assert d["engine"] == "DualPipeVEngine"
        assert tuple(d["positional"]) == (True, True)
        assert "PipelineEngine cannot run a DualPipeVModule" in d["plain_engine"]
        assert "picks DualPipeVEngine" in d["plain_engine"]
        close(d["losses"], ref["losses"])
        close(d["untagged"], ref["losses"])  # a group per edge, as NCCL needs
        close([d["eval"]], [sum(per_mb) / 3])
        assert d["keyed"]["type"] == "DualPipeVModule" and len(d["keyed"]["parts"]) == 5
        close(d["keyed"]["losses"], keyed_ref)
        close(d["ragged"], ragged_ref["losses"])
    # the loss stage is stage 0: the logits and upstream's total_loss live there
    assert runs[0]["dualpipev"]["logits"] == [pr.MICRO, pr.SEQ, pr.VOCAB]
    close([runs[0]["dualpipev"]["total_loss"]], [sum(per_mb)])
    assert runs[1]["dualpipev"]["logits"] is None and runs[1]["dualpipev"]["total_loss"] is None


def test_wall_clock_breakdown_times_the_pipeline_instructions(runs: list[dict]) -> None:
    """Upstream's timer names, per stage: the first stage loads inputs, sends activations and
    receives gradients; the last the reverse (and loads labels). The parts stay within the
    batch's time, which the timing leaves unchanged."""
    from deepspeed.runtime.pipe import engine as upstream_names

    ref = pr.reference(2, 2, 1)
    names = [
        upstream_names.BATCH_INPUT_TIMER,
        upstream_names.PIPE_SEND_OUTPUT_TIMER,
        upstream_names.PIPE_RECV_INPUT_TIMER,
        upstream_names.PIPE_SEND_GRAD_TIMER,
        upstream_names.PIPE_RECV_GRAD_TIMER,
    ]
    expected = (
        {"batch_input", "pipe_send_output", "pipe_recv_grad"},  # the first stage
        {"batch_input", "pipe_recv_input", "pipe_send_grad"},  # the last
    )
    for r, mine in zip(runs, expected):
        window = r["timed"]["window"]
        got = {n for n in names if f"{n}_ms" in window}
        assert got == mine, (sorted(window), mine)
        assert all(window[f"{n}_ms"] > 0 for n in got)
        parts = sum(window[f"{n}_ms"] for n in got)
        parts += window["forward_ms"] + window["backward_ms"] + window["step_ms"]
        assert parts <= window[f"{upstream_names.TRAIN_BATCH_TIMER}_ms"] * 1.01, window
    for r in runs:
        close(r["timed"]["losses"], ref["losses"])


def test_eval_loss_reaches_the_monitors(runs: list[dict]) -> None:
    """Upstream's Train/Samples/eval_loss event, written by rank 0 (the first stage) even
    with bcast_loss=False: the loss comes from the last stage for it."""
    model = pr.reference(2, 2, 1)["model"].eval()
    with torch.no_grad():
        per_mb = [float(pr.lm_loss(model(ids), labels)) for ids, labels in pr.batches(99, 0, 2)]
    rows = runs[0]["timed"]["rows"]
    assert [r["step"] for r in rows if "loss" in r] == [2]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(evals) == 1 and evals[0]["step"] == 2, rows
    close([evals[0]["eval_loss"]], [sum(per_mb) / 2])
    close([runs[0]["timed"]["eval"]], [sum(per_mb) / 2])
    assert runs[1]["timed"]["rows"] == []  # only rank 0 writes


def test_additional_losses_reach_the_metrics_on_every_stage(runs: list[dict]) -> None:
    """get_additional_losses, returned on the last stage only: the window's mean of the
    batch means (steps 1 and 2 of the reference), on both stages' metrics."""
    ref = pr.reference(2, 2, 1)
    for r in runs:
        close([r["timed"]["window"]["logits_sq"]], [sum(ref["aux"]) / 2])


def test_activation_checkpointing_changes_nothing(runs: list[dict]) -> None:
    ref = pr.reference(3, 2, 1)
    for r in runs:
        close(r["checkpointed"]["losses"], ref["losses"])


def test_fp16_tracks_the_fp32_reference(runs: list[dict]) -> None:
    ref = pr.reference(3, 2, 1)
    for r in runs:
        assert r["fp16"]["skipped"] == 0
        close(r["fp16"]["losses"], ref["losses"], tol=2e-2)


def test_fp16_stages_skip_and_scale_together(runs: list[dict]) -> None:
    a, b = runs[0]["fp16_overflow"], runs[1]["fp16_overflow"]
    assert a["skipped"] == b["skipped"] >= 1  # 2**30 overflows on the last stage: all skip
    assert a["scale"] == b["scale"] < 2.0**30
    assert a["losses"] == b["losses"]


def test_zero_bubble_fp16_and_activation_checkpointing(runs: list[dict]) -> None:
    ref = pr.reference(3, 2, 1)
    ref4 = pr.reference(3, 4, 1)
    for r in runs:
        assert r["zb_fp16"]["skipped"] == 0
        close(r["zb_fp16"]["losses"], ref["losses"], tol=2e-2)
        for name in ("zb_checkpointed", "zb_reentrant", "zb_reentrant_ours"):
            assert r[name]["schedule"] == "zb-h1"
            close(r[name]["losses"], ref4["losses"])
        assert r["zb_checkpointed"]["unsplit"] == 0  # non-reentrant recompute splits
        # reentrant (torch's, and deepspeed.checkpointing's) runs whole, still right
        assert r["zb_reentrant"]["unsplit"] == r["zb_reentrant_ours"]["unsplit"] == 3 * 4


def test_a_non_tensor_at_dualpipevs_turn_is_named(runs: list[dict]) -> None:
    turn, other = runs[1]["turn_non_tensor"], runs[0]["turn_non_tensor"]
    assert turn["error"] == "TypeError", turn
    assert "output of virtual stage 1: element 1 is a NoneType" in turn["message"]
    assert other["error"] == "PipeAborted"


def test_config_key_cuts_a_sequential_passing_int_masks(runs: list[dict]) -> None:
    ref = ps.sequential_reference(3, 2)
    for r in runs:
        assert len(r["config_key"]["parts"]) == 3
        close(r["config_key"]["losses"], ref)
        assert "set_has_attention_mask(1)" in r["config_key"]["refused"]


def test_dynamic_shapes(runs: list[dict]) -> None:
    ref = pr.reference(3, 2, 1, data=lambda step, d, gas: ps._ragged(step, gas))
    for r in runs:
        close(r["dynamic"]["losses"], ref["losses"])
        close(r["reset_shapes"]["losses"], ref["losses"])  # upstream's reset_activation_shape


def test_shape_change_fails_on_both_stages(runs: list[dict]) -> None:
    sender, receiver = runs[0]["shape_change"], runs[1]["shape_change"]
    assert sender["error"] == "ValueError"
    assert "changed shape mid-run" in sender["message"]
    assert "dynamic_shape=True" in sender["message"]
    assert "reset_activation_shape()" in sender["message"]
    assert receiver["error"] == "PipeAborted"


def test_missing_data_iterator_fails_everywhere_before_any_p2p(runs: list[dict]) -> None:
    for r in runs:
        assert r["missing_iterator"]["error"] == "PipelineError"
        assert "rank(s) [1]" in r["missing_iterator"]["message"]


def test_iterator_missing_later_fails_on_both_stages(runs: list[dict]) -> None:
    last, first = runs[1]["iterator_lost_later"], runs[0]["iterator_lost_later"]
    assert last["error"] == "PipelineError" and "no data iterator" in last["message"]
    assert first["error"] == "PipelineError", first
    assert "another rank's stage failed to read its micro-batches" in first["message"]


def test_missing_loss_fn(runs: list[dict]) -> None:
    last, first = runs[1]["missing_loss_fn"], runs[0]["missing_loss_fn"]
    assert last["error"] == "ValueError" and "loss_fn=" in last["message"]
    assert first["error"] == "PipeAborted"


def test_a_stage_with_no_gradient_to_send_says_why(runs: list[dict]) -> None:
    last, first = runs[1]["detached_stage"], runs[0]["detached_stage"]
    assert first["error"] == "PipelineError" and "use_reentrant=False" in first["message"]
    assert "stage 0 sends stage 1 an output that needs no gradient" in first["message"]
    assert last["error"] == "PipeAborted"


def test_eval_data_running_out_stops_every_stage_and_training_goes_on(runs: list[dict]) -> None:
    for r in runs:
        got = r["eval_runs_out"]
        assert got["eval"]["error"] == "StopIteration", got["eval"]
        assert got["after"] == got["plain"], got


def test_training_data_running_out_stops_every_stage_and_training_goes_on(
    runs: list[dict],
) -> None:
    for r in runs:
        got = r["train_runs_out"]
        for when in ("short", "short_last", "end"):  # mid-iterator, set_dataloader's end
            assert got[when]["error"] == "StopIteration", got[when]
        assert got["got"] == got["plain"], got
    assert "ran out on another rank's stage" in runs[1]["train_runs_out"]["short"]["message"]
    assert "ran out on another rank's stage" in runs[0]["train_runs_out"]["short_last"]["message"]


def test_a_stopped_batch_leaves_random_streams_and_norm_stats_as_they_were(
    runs: list[dict],
) -> None:
    """Dropout without seed_layers and a BatchNorm on the first stage, which forwarded its
    first micro-batch before the batch stopped: the next batches draw the same masks and
    the stats match an engine that never ran out."""
    got = runs[0]["stopped_undone"]
    assert got["stats"] == 2, got  # the norm is on the first stage
    assert got["stats_equal"], got
    for r in runs:
        assert r["stopped_undone"]["got"] == r["stopped_undone"]["plain"], r["stopped_undone"]


def test_an_engine_whose_batch_failed_refuses_the_next(runs: list[dict]) -> None:
    for r in runs:
        got = r["failed_batch"]
        assert got["first"]["error"] in ("ValueError", "RuntimeError", "PipeAborted"), got
        assert got["then"]["error"] == "PipelineError", got["then"]
        assert "an earlier batch failed" in got["then"]["message"], got["then"]
        assert got["first"]["error"] in got["then"]["message"], got
        assert got["again"]["error"] == "PipelineError", got["again"]  # eval_batch too


def test_a_frozen_first_stage_trains_the_rest_as_the_reference(runs: list[dict]) -> None:
    """Stage 0 frozen: its rank builds an optimizer with nothing to step, stage 1 sends it an
    empty gradient message (nothing it got needs one), and the rest trains as a single
    process with the same layers frozen does."""
    n0 = runs[0]["frozen_first_stage"]["frozen_layers"]

    def freeze(model: pr.Reference) -> None:
        for layer in list(model.layers)[:n0]:
            layer.requires_grad_(False)

    losses = pr.reference(3, 2, 1, tied=False, freeze=freeze)["losses"]
    for name in ("frozen_first_stage", "frozen_client_object"):  # ZeRO 1 config, ZeRO 2 object
        for r in runs:
            close(r[name]["losses"], losses)
        assert not any(runs[0][name]["moved"])
        assert all(runs[1][name]["moved"])


def test_a_client_optimizer_with_groups_and_scheduler_trains_tied_weights(runs: list) -> None:
    ref = pr.reference(3, 2, 1, optimizer=pr.decay_groups)["losses"]
    for r in runs:
        got = r["client_groups_tied"]
        for stage in (1, 2):
            close(got[f"zero{stage}"], ref)
            # every group at the scheduler's lr, the tied weights' group too
            assert len(set(got[f"lrs{stage}"])) == 1 and len(got[f"lrs{stage}"]) >= 2, got
        spread = got["spread"]
        assert spread["error"] == "ValueError", spread
        assert "key 'embed' are in 2 of the param groups" in spread["message"]


def test_tied_weights_frozen_alike_or_refused(runs: list[dict]) -> None:
    for r in runs:
        refused = r["tied_frozen"]["refused"]
        assert refused["error"] == "ValueError", refused
        assert "TiedLayerSpec key 'embed' are frozen" in refused["message"], refused
    losses = pr.reference(3, 2, 1, freeze=lambda m: m.embed.requires_grad_(False))["losses"]
    for r in runs:
        close(r["tied_frozen"]["losses"], losses)


def test_a_detached_gradient_path_through_a_frozen_stage_says_where(runs: list[dict]) -> None:
    cut, other = runs[1]["gradient_cut"], runs[0]["gradient_cut"]
    assert cut["error"] == "PipelineError", cut
    assert "stage 1 sends stage 0 an output that needs no gradient" in cut["message"], cut
    assert "its input needs one" in cut["message"], cut
    assert other["error"] == "PipeAborted", other


def test_interleaving_a_batch_it_cannot_run_is_refused_at_initialize(runs: list[dict]) -> None:
    for r in runs:
        got = r["interleaved_odd_gas"]
        assert got["error"] == "ValueError", got
        assert "gradient_accumulation_steps=3 is not a multiple of 2" in got["message"]

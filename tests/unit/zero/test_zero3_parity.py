"""ZeRO stage 3 gives the parameters stage 0 gives, on 2 and 4 real gloo ranks: partitioned
parameters gathered by module hooks, gradients reduce-scattered into shards."""

import os

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.zero.test_zero_parity import SGD_NO_CLIP, _assert_same, stage0
from tests.unit.zero.zero_runs import Net, train, train_gpt


def z3(**zero) -> dict:
    # threshold 0: every parameter is partitioned and gathered (none persists)
    return {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 0,
            **zero,
        }
    }


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_matches_stage0(world):
    ref = stage0(world)
    got = run_ranks(train, world, 3, 4, 2, z3())
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


def test_sgd_without_clipping_matches_stage0():
    ref = stage0(2, 4, 2, SGD_NO_CLIP)
    got = run_ranks(train, 2, 3, 4, 2, {**SGD_NO_CLIP, **z3()})
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


def test_persistent_params_match_stage0():
    """Default threshold: this model's small parameters all stay gathered."""
    ref = stage0(2)
    got = run_ranks(train, 2, 3, 4, 2, z3(stage3_param_persistence_threshold=100_000))
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


def test_cpu_param_and_optimizer_offload_match_stage0():
    ref = stage0(2)
    off = z3(
        offload_param={"device": "cpu", "pin_memory": True},
        offload_optimizer={"device": "cpu", "pin_memory": True},
    )
    got = run_ranks(train, 2, 3, 4, 2, off)
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)


def test_bf16_tracks_stage0():
    bf16 = {"bf16": {"enabled": True}}
    ref = stage0(2, 4, 2, bf16)
    got = run_ranks(train, 2, 3, 4, 2, {**bf16, **z3()})
    _assert_same(got, ref, atol=1e-2, rtol=1e-2)


def test_gpt_tied_weights_nested_modules_match_stage0():
    """Tied embeddings (one parameter in two modules), nested blocks, a module list. Each use
    of the tied weight runs on its own alias, reduced on its own ([Note: per-use aliases of
    tied parameters]): 2 uses in each of 6 micro-steps."""
    ref = run_ranks(train_gpt, 2, 0)
    got = run_ranks(train_gpt, 2, 3)
    assert got[0]["stats"]["tied_uses"] == 12, got[0]["stats"]
    # Stage 2 differs from stage 0 by the same 6e-5 here (the reduce-scatter sums in another
    # order and Adam magnifies it where gradients are tiny); a wrong gradient moves params by
    # about lr = 1e-2 per step.
    _assert_same(got, ref[0], atol=1e-4, rtol=1e-3)
    for a, b in zip(got[0]["losses"], ref[0]["losses"]):
        assert abs(a - b) < 1e-4, (got[0]["losses"], ref[0]["losses"])


def test_leaf_modules_are_gathered_whole():
    ref = run_ranks(train_gpt, 2, 0)
    got = run_ranks(train_gpt, 2, 3, 3, None, True)
    _assert_same(got, ref[0], atol=1e-4, rtol=1e-3)
    # two leaf Blocks: each gathers once per forward and once per backward, no sub-gathers
    assert got[0]["stats"]["fetches"] < run_ranks(train_gpt, 2, 3)[0]["stats"]["fetches"]


def test_prefetch_and_reuse_change_nothing_but_timing():
    """Prefetching along the recorded order and keeping parameters for a near reuse give the
    same bits as gathering each module on demand and releasing it at once."""
    on_demand = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    eager = {"stage3_prefetch_bucket_size": 10**9, "stage3_max_reuse_distance": 10**9}
    a = run_ranks(train_gpt, 2, 3, 3, on_demand)
    b = run_ranks(train_gpt, 2, 3, 3, eager)
    assert a[0]["stats"]["prefetched"] == 0 and a[0]["stats"]["kept"] == 0
    assert b[0]["stats"]["prefetched"] > 0 and b[0]["stats"]["kept"] > 0, b[0]["stats"]
    for n, p in a[0]["params"].items():
        assert torch.equal(p, b[0]["params"][n]), n


def test_nvme_param_and_optimizer_offload_match_stage0(tmp_path):
    """Shards and the optimizer's masters and moments in swap files (the C++ aio op); the
    optimizer steps in sub-groups of 500 elements, so it runs several per step."""
    ref = stage0(2)
    nvme = z3(
        offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
        sub_group_size=500,
        stage3_prefetch_bucket_size=100,
    )
    got = run_ranks(train, 2, 3, 4, 2, nvme)
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    assert got[0]["swapped"]["params"] > 0 and got[0]["swapped"]["optimizer_bytes"] > 0
    # fp32 model: every swapped trainable shard is read from its master's file ([Note: one
    # file for a shard and its master]) and has no file of its own; the frozen embed.bias
    # (no master) keeps its own: 20 fp32 elements a rank
    swapped = got[0]["swapped"]
    assert swapped["shared"] == swapped["params"] - 1, swapped
    assert swapped["param_bytes"] == 20 * 4, swapped
    # offload_param's default 5 buffers: shards beyond the gather window (one module's worth
    # here) are read ahead, and their gathers find them read
    assert got[0]["swapped"]["fetched_ahead"] > 0, got[0]["swapped"]
    # by default the sub-groups step in the next forward ([Note: optimizer steps in
    # forward]; the last step's as the run gathers the parameters at its end)
    assert swapped["stepped_in_forward"] > 0, swapped
    assert not list(tmp_path.rglob("*.swp")), "swap files are removed at the end"


def test_pipelined_nvme_optimizer_swap_matches_stage0(tmp_path):
    """offload_optimizer.pipeline_read / pipeline_write ([Note: pipelined optimizer swap]):
    each sub-group's read and write overlap a neighbour's step, and training is unchanged."""
    ref = stage0(2)
    # the swap in engine.step(): not the default next-forward steps
    off = {"device": "nvme", "nvme_path": str(tmp_path), "step_in_forward": False}
    pipe = {**off, "pipeline_read": True, "pipeline_write": True}
    got = run_ranks(train, 2, 3, 4, 2, z3(offload_optimizer=pipe, sub_group_size=500))
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    swapped = got[0]["swapped"]
    assert swapped["overlapped_reads"] > 0 and swapped["overlapped_writes"] > 0, swapped
    plain = run_ranks(train, 2, 3, 4, 2, z3(offload_optimizer=off, sub_group_size=500))
    assert plain[0]["swapped"]["overlapped_reads"] == 0, plain[0]["swapped"]
    assert not list(tmp_path.rglob("*.swp")), "swap files are removed at the end"


NO_CLIP = {"gradient_clipping": 0.0}


def test_nvme_optimizer_steps_in_backward_match_stage0(tmp_path):
    """offload_optimizer.step_in_backward ([Note: optimizer steps in backward]): sub-groups of
    masters whose gradients are final step during the backward (with gradient accumulation:
    only at the boundary); the parameters are those of stage 0 without it."""
    ref = stage0(2, 4, 2, NO_CLIP)
    nvme = z3(
        offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path), "step_in_backward": True},
        sub_group_size=200,
    )
    got = run_ranks(train, 2, 3, 4, 2, {**NO_CLIP, **nvme})
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    # 4 steps; the head's and body's masters fill a 200-element sub-group more than once
    # before the embedding's gradient comes, so some sub-groups step in every backward
    assert got[0]["swapped"]["stepped_in_backward"] >= 4, got[0]["swapped"]
    assert not list(tmp_path.rglob("*.swp")), "swap files are removed at the end"


def _plain_backward_steps_in_backward(path: str) -> dict:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("deepspeed_ext").addHandler(handler)
    opt = {"device": "nvme", "nvme_path": path, "step_in_backward": True}
    zero = z3(offload_optimizer=opt, sub_group_size=200)
    out = train(3, 4, 2, {**NO_CLIP, **zero}, plain_backward=True)
    out["notes"] = [r.getMessage() for r in records if "step_in_backward" in r.getMessage()]
    return out


def test_plain_backward_with_steps_in_backward_says_so_once(tmp_path):
    """loss.backward() does not tell the engine where the accumulation boundary is: nothing
    steps early, training is as without the key, and a warning says so once."""
    ref = stage0(2, 4, 2, NO_CLIP)
    got = run_ranks(_plain_backward_steps_in_backward, 2, str(tmp_path))
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    assert got[0]["swapped"]["stepped_in_backward"] == 0, got[0]["swapped"]
    assert len(got[0]["notes"]) == 1 and "loss.backward()" in got[0]["notes"][0], got[0]["notes"]


def test_steps_in_backward_leave_tied_weights_to_the_step(tmp_path):
    """The GPT's tied embedding gets a gradient per use: it steps in engine.step(), the
    blocks' masters in the backward. Each element's update is the one the whole step after
    the backward makes: the parameters equal those without the key, bit for bit."""
    opt = {"device": "nvme", "nvme_path": str(tmp_path)}
    after = run_ranks(
        train_gpt, 2, 3, 3, {"offload_optimizer": opt, "sub_group_size": 2000}, False, 0.0
    )
    opt_in = {**opt, "step_in_backward": True}
    got = run_ranks(
        train_gpt, 2, 3, 3, {"offload_optimizer": opt_in, "sub_group_size": 2000}, False, 0.0
    )
    assert got[0]["stats"]["stepped_in_backward"] >= 3, got[0]["stats"]
    assert "stepped_in_backward" not in after[0]["stats"], after[0]["stats"]
    for a, b in zip(got, after):
        assert a["losses"] == b["losses"]
        for n in b["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n


def _step_in_backward_misuse(path: str, case: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.runtime.models import batch

    opt = {"device": "nvme", "nvme_path": path, "step_in_backward": True}
    size = 10**9 if case == "sub_group" else 200
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **z3(offload_optimizer=opt, sub_group_size=size),
    }
    try:
        engine, _, _, _ = initialize(model=Net(), config=cfg)
        for _ in range(2):  # two boundary backwards, no step between
            x, y = batch(0, 0, 4)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if case == "save":  # a checkpoint with the step part way done
                engine.save_checkpoint(os.path.join(path, "ck"))
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def test_steps_in_backward_misuse_is_refused_by_name(tmp_path):
    msgs = [
        run_ranks(_step_in_backward_misuse, 1, str(tmp_path), c)[0]
        for c in ("sub_group", "twice", "save")
    ]
    assert "sub_group_size=1000000000" in msgs[0] and "set sub_group_size to about" in msgs[0]
    assert "call engine.step() before the next backward" in msgs[1], msgs[1]
    assert msgs[2].startswith("a checkpoint save or load between a boundary backward"), msgs[2]


def test_bf16_nvme_keeps_shard_files_of_their_own(tmp_path):
    """A bf16 shard is not its fp32 master's bytes: each keeps its own file."""
    bf16 = {"bf16": {"enabled": True}}
    ref = stage0(2, 4, 2, bf16)
    nvme = z3(
        offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
        offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)},
    )
    got = run_ranks(train, 2, 3, 4, 2, {**bf16, **nvme})
    _assert_same(got, ref, atol=1e-2, rtol=1e-2)
    assert got[0]["swapped"]["shared"] == 0 and got[0]["swapped"]["param_bytes"] > 0


def test_nvme_without_read_ahead_buffers_matches_stage0(tmp_path):
    """offload_param.buffer_count 0: every shard is read when its gather wants it."""
    ref = stage0(2)
    off = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_count": 0}
    got = run_ranks(train, 2, 3, 4, 2, z3(offload_param=off))
    _assert_same(got, ref, atol=2e-6, rtol=1e-5)
    assert got[0]["swapped"]["read_ahead"] == 0 and got[0]["swapped"]["params"] > 0


def _too_small_buffers(path: str) -> str:
    off = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_size": 10}
    try:
        train(3, 1, 1, z3(offload_param=off))
    except ValueError as e:
        return str(e)
    return "no error"


def test_nvme_buffers_smaller_than_a_shard_are_refused_by_name(tmp_path):
    msg = run_ranks(_too_small_buffers, 1, str(tmp_path))[0]
    assert "offload_param.buffer_size=10" in msg and "raise it to at least" in msg, msg

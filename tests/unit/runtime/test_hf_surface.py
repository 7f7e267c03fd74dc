"""The pieces of upstream's surface that the HF Trainer and Accelerate call, without HF:
clone_tensors_for_torch_save, the config read as a dict, the consolidated weights and
save_16bit_model, and a resume from a checkpoint saved without its frozen parameters."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, loss_fn, mlp


def test_clone_tensors_for_torch_save_owns_exactly_its_elements():
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(10.0)
    item = {"a": flat[:3], "nested": [flat[3:5], (flat[5:], 7)], "name": "x"}
    out = clone_tensors_for_torch_save(item)
    assert out["name"] == "x" and out["nested"][1][1] == 7
    assert isinstance(out["nested"], list) and isinstance(out["nested"][1], tuple)
    for got, want in [(out["a"], flat[:3]), (out["nested"][0], flat[3:5])]:
        assert torch.equal(got, want)
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size()
    out["a"][0] = 100.0
    assert flat[0] == 0.0


def test_config_reads_as_the_dict_accelerate_wrote():
    from deepspeed_ext.config import parse

    # accelerate always writes steps_per_print = inf ("never"); the Trainer reads
    # engine.config.get("zero_optimization", {}).get("stage") as upstream's dict
    cfg = parse(
        {"train_batch_size": 8, "steps_per_print": float("inf"), "zero_optimization": {"stage": 2}}
    )
    assert cfg.steps_per_print is None
    assert cfg.get("zero_optimization", {}).get("stage") == 2
    assert cfg["train_batch_size"] == 8
    assert cfg.get("no_such_key", "default") == "default"


def _consolidated(stage: int, save_dir: str) -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    model = mlp(seed=0)
    model[0].requires_grad_(False)  # frozen, as a PEFT base
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = initialize(model=model, config=cfg)
    x, y = batch(0, engine.rank)
    engine.backward(loss_fn(engine, x, y))
    engine.step()
    full = engine._zero3_consolidated_16bit_state_dict()
    trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    saved = engine.save_16bit_model(save_dir, "weights.bin")
    own = {k: v.clone() for k, v in engine.module.state_dict().items()}
    if full is None:
        return {"rank": engine.rank, "full": None, "trainable": trainable, "saved": saved}
    return {
        "rank": engine.rank,
        "saved": saved,
        "gather_flag": engine.zero_gather_16bit_weights_on_model_save(),
        "matches": all(torch.equal(full[k], v) for k, v in own.items())
        and full.keys() == own.keys(),
        "lean": all(t.untyped_storage().nbytes() == t.numel() * 4 for t in full.values()),
        "trainable_keys": sorted(trainable or {}),
        "file_matches": all(
            torch.equal(v, own[k])
            for k, v in torch.load(f"{save_dir}/weights.bin", weights_only=True).items()
        ),
    }


def _consolidated_stages(stages: list[int], save_dir: str) -> list[dict]:
    return [_consolidated(s, f"{save_dir}/stage{s}") for s in stages]  # one spawn for all


def test_consolidated_weights_on_rank_0_and_save_16bit_model(tmp_path):
    rank0, rank1 = run_ranks(_consolidated_stages, 2, [0, 2], str(tmp_path))
    for r0, r1 in zip(rank0, rank1):
        assert r1["full"] is None and r1["trainable"] is None and r1["saved"] is True
        assert r0["saved"] and r0["matches"] and r0["lean"] and r0["file_matches"]
        assert r0["gather_flag"] is False  # stage3_gather_16bit_weights_on_model_save's default
        assert r0["trainable_keys"] == ["2.bias", "2.weight", "4.bias", "4.weight"]


def _resume_without_frozen(save_dir: str) -> dict:
    from deepspeed_ext.runtime.checkpoint import CheckpointError
    from deepspeed_ext.runtime.initialize import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
    }

    def engine_for(seed: int):
        model = mlp(seed=seed)
        model[0].requires_grad_(False)
        return initialize(model=model, config=cfg)[0]

    first = engine_for(0)
    x, y = batch(0, 0)
    first.backward(loss_fn(first, x, y))
    first.step()
    first.save_checkpoint(save_dir, exclude_frozen_parameters=True)
    second = engine_for(1)
    frozen_before = second.module[0].weight.detach().clone()
    second.load_checkpoint(save_dir)  # strict: the frozen keys it lacks are allowed missing
    wider = initialize(model=torch.nn.Sequential(mlp(), torch.nn.Linear(4, 4)), config=cfg)[0]
    try:
        wider.load_checkpoint(save_dir)
        mismatch = "loaded"
    except CheckpointError as e:
        mismatch = str(e)
    return {
        "trainable_loaded": all(
            torch.equal(a, b)
            for a, b in zip(first.module[2:].parameters(), second.module[2:].parameters())
        ),
        "frozen_kept": torch.equal(second.module[0].weight, frozen_before),
        "mismatch": mismatch,
    }


def test_strict_load_accepts_the_frozen_parameters_a_save_left_out(tmp_path):
    (r,) = run_ranks(_resume_without_frozen, 1, str(tmp_path))
    assert r["trainable_loaded"] and r["frozen_kept"]
    assert "does not match the model" in r["mismatch"], r["mismatch"]

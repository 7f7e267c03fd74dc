"""ZeRO checkpoints: exact resume at the same world size, zero_to_fp32 equal to the live
weights, and a clear refusal at another world size."""

import subprocess
import sys

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.subproc import env_with

CFG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1000,
}


def _steps(engine, first: int, n: int) -> list[float]:
    import os

    from tests.unit.runtime.models import batch, loss_fn

    rank = int(os.environ["RANK"])
    out = []
    for s in range(first, first + n):
        for m in range(2):
            x, y = batch(10 * s + m, rank, size=4)
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
            out.append(float(loss))
    return out


def _resume(stage: int, save_dir: str) -> dict:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    cfg = {**CFG, "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}
    full, *_ = initialize(model=Net(), config=cfg)
    want = _steps(full, 0, 6)[6:]
    a, *_ = initialize(model=Net(), config=cfg)
    _steps(a, 0, 3)
    a.save_checkpoint(save_dir)
    live = {n: p.detach().float().clone() for n, p in a.module.named_parameters()}
    torch.manual_seed(99)
    b, *_ = initialize(model=Net(), config=cfg)
    b.load_checkpoint(save_dir)
    got = _steps(b, 3, 3)
    return {"want": want, "got": got, "live": live}


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_is_exact_and_zero_to_fp32_equals_live_weights(stage, tmp_path):
    results = run_ranks(_resume, 2, stage, str(tmp_path))
    for r in results:
        assert r["got"] == r["want"], "resumed run differs from the uninterrupted one"
    names = sorted((tmp_path / "global_step3").iterdir())
    assert [n.name for n in names] == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    live = results[0]["live"]
    assert set(live) <= set(sd)
    for n, p in live.items():
        assert torch.equal(sd[n], p), n

    # the CLI, to sharded safetensors
    out = tmp_path / "fp32"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.utils.zero_to_fp32",
            str(tmp_path),
            str(out),
            "--safe_serialization",
            "--max_shard_size",
            "2KB",
        ],
        env=env_with(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    shards = sorted(out.glob("model*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    merged = {k: v for f in shards for k, v in load_file(str(f)).items()}
    for n, p in live.items():
        assert torch.equal(merged[n], p), n


def _save(save_dir: str) -> None:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    e, *_ = initialize(model=Net(), config={**CFG, "zero_optimization": {"stage": 2}})
    _steps(e, 0, 1)
    e.save_checkpoint(save_dir)


def _load_elsewhere(save_dir: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    e, *_ = initialize(model=Net(), config={**CFG, "zero_optimization": {"stage": 2}})
    try:
        e.load_checkpoint(save_dir)
    except NotImplementedError as exc:
        return str(exc)
    return "loaded"


def test_other_world_size_is_refused_with_the_way_out(tmp_path):
    run_ranks(_save, 2, str(tmp_path))
    (msg,) = run_ranks(_load_elsewhere, 1, str(tmp_path))
    assert "written by 2 ranks" in msg and "zero_to_fp32" in msg

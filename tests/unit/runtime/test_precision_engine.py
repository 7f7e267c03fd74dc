"""bf16 and fp16 through the engine: master weights, skipped overflow steps, the scale."""

import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, loss_fn, mlp


def _run(cfg_extra: dict, steps: int, inject_inf_at: set[int] = frozenset()) -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 1000,
        **cfg_extra,
    }
    engine, *_ = initialize(model=mlp(), config=cfg)
    scales, params_before_after = [], {}
    for s in range(steps):
        x, y = batch(s, 0)
        loss = loss_fn(engine, x, y)
        if s in inject_inf_at:
            before = [p.detach().clone() for p in engine.module.parameters()]
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        if s in inject_inf_at:
            after = [p.detach().clone() for p in engine.module.parameters()]
            params_before_after[s] = all(torch.equal(a, b) for a, b in zip(before, after))
        scales.append(engine.loss_scaler.loss_scale if engine.loss_scaler else 1.0)
    masters = [m.detach().clone() for m in engine.strategy.masters.masters]
    model = [p.detach().clone() for p in engine.module.parameters()]
    return {
        "scales": scales,
        "skipped": engine.skipped_steps,
        "unchanged": params_before_after,
        "masters": masters,
        "model": model,
        "final_loss": float(loss),
        "dtypes": {p.dtype for p in engine.module.parameters()},
    }


def test_bf16_keeps_fp32_masters_and_tracks_fp32_training():
    bf16, fp32 = (
        run_ranks(_run, 1, {"bf16": {"enabled": True}}, 30)[0],
        run_ranks(_run, 1, {}, 30)[0],
    )
    assert bf16["dtypes"] == {torch.bfloat16}
    assert all(m.dtype == torch.float32 for m in bf16["masters"])
    for m, p in zip(bf16["masters"], bf16["model"]):
        assert torch.equal(m.to(torch.bfloat16), p), "model weights must be the rounded masters"
    for a, b in zip(bf16["masters"], fp32["masters"]):
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.02)  # bf16 forward: loose


def test_fp16_overflow_skips_step_halves_scale_then_grows():
    fp16 = {
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1}
    }
    (r,) = run_ranks(_run, 1, fp16, 8, {2})
    assert r["skipped"] == 1
    assert r["unchanged"][2], "an overflowing step must leave the params untouched"
    assert r["scales"][:2] == [256.0, 256.0]
    assert r["scales"][2] == 128.0, r["scales"]
    assert r["scales"][5] == 256.0, r["scales"]  # 3 clean steps later it doubles
    assert r["dtypes"] == {torch.float16}


def _min_scale(_: int) -> str:
    from deepspeed_ext.runtime.precision import LossScaleError

    try:
        _run(
            {
                "fp16": {
                    "enabled": True,
                    "initial_scale_power": 2,
                    "min_loss_scale": 1,
                    "hysteresis": 1,
                }
            },
            10,
            set(range(10)),
        )
    except LossScaleError as exc:
        return str(exc)
    return "no stop"


def test_fp16_stops_at_min_scale_recommending_bf16():
    (msg,) = run_ranks(_min_scale, 1, 0)
    assert "bf16" in msg and "minimum loss scale" in msg

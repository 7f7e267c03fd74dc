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
    # upstream's count: 3 clean steps after the first one following the overflow
    assert r["scales"][5] == 128.0 and r["scales"][6] == 256.0, r["scales"]
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


def _surface() -> dict:
    """Upstream's engine and optimizer surface around the loss scale, the norm and clipping."""
    from deepspeed_ext.runtime.initialize import initialize

    out: dict = {}
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "adam_w_mode": True}},
        "fp16": {"enabled": True, "initial_scale_power": 10},
        "gradient_clipping": 1.0,
    }
    engine, opt, *_ = initialize(model=mlp(), config=cfg)
    out["scale_attrs"] = (opt.loss_scale, opt.cur_scale, opt.dynamic_loss_scale)
    x, y = batch(0, 0)
    import copy

    plain = copy.deepcopy(engine.module).float()  # the reference gradient, unscaled
    (loss_fn(plain, x, y) / 4).backward()
    want = float(torch.stack([p.grad.norm() for p in plain.parameters()]).norm())
    loss = loss_fn(engine, x, y)
    out["returned"] = (float(engine.backward(loss)), float(loss) / 4)
    # clip_fp32_gradients measures unscaled gradients (it measured them times 1024)
    out["clip_norm"] = (engine.clip_fp32_gradients(), want)
    engine.step()
    for _ in range(3):
        engine.backward(loss_fn(engine, x, y) * float("inf"))
        engine.step()
    out["overflow_norm"] = engine.get_global_grad_norm()
    return out


def test_upstreams_surface_of_scale_norm_and_clipping():
    """engine.backward returns the loss over the accumulation steps; an overflowed step's
    norm is inf (it was the last applied step's, or None); the optimizer carries the fp16
    scale; adam_w_mode is taken in an AdamW section (true: false is refused, as the config
    tests check); clip_fp32_gradients measures unscaled
    gradients (found by a fuzzing helper against upstream 0.19.8)."""
    (r,) = run_ranks(_surface, 1)
    assert r["scale_attrs"] == (1024.0, 1024.0, True)
    got, want = r["returned"]
    assert abs(got - want) < 1e-6 * abs(want), r["returned"]
    norm, ref = r["clip_norm"]
    assert abs(norm - ref) < 0.02 * ref, r["clip_norm"]  # an fp16 forward
    assert r["overflow_norm"] == float("inf")


def test_clipping_scales_a_norm_just_below_max_norm_as_torch_does():
    """torch scales by max_norm / (norm + 1e-6) whenever that is below 1: with a tiny
    max_norm (1e-6), a norm of 5e-7 is scaled to 3.3e-7; it was left at 5e-7."""
    from deepspeed_ext.runtime.grad_clip import clip_factor

    g = torch.tensor([5e-7])
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 1e-6)
    assert abs(g.item() * clip_factor(1.0, 5e-7, 1e-6) - p.grad.item()) < 1e-12
    assert clip_factor(0.5, 5.0, 10.0) == 0.5  # far below: unscaled only

"""FusedLamb (CPU path) against a plain float64 LAMB written from [Note: lamb math]."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from deepspeed_ext.ops.lamb import FusedLamb
from tests.helpers.optim_parity import (
    clone_params,
    make_grads,
    make_params,
    state_dict_roundtrip,
)

HP_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    eps_inside_sqrt=False,
    weight_decay=0.0,
    bias_correction=True,
    max_coeff=10.0,
    min_coeff=0.01,
)


def reference_lamb_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    grad_scale: float = 1.0,
    **hp: Any,
) -> float:
    """One upstream-DeepSpeed LAMB step on float64 tensors, in place; returns the coeff."""
    hp = {**HP_DEFAULTS, **hp}
    beta1, beta2 = hp["betas"]
    g = g / grad_scale
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    denom = (v + hp["eps"]).sqrt() if hp["eps_inside_sqrt"] else v.sqrt() + hp["eps"]
    update = m / denom + hp["weight_decay"] * p
    w_norm, u_norm = float(p.norm()), float(update.norm())
    coeff = 1.0
    if w_norm != 0 and u_norm != 0:
        coeff = w_norm / u_norm
        coeff = hp["max_coeff"] if coeff > hp["max_coeff"] else coeff
        coeff = hp["min_coeff"] if coeff < hp["min_coeff"] else coeff
    step_size = hp["lr"]
    if hp["bias_correction"]:
        step_size *= math.sqrt(1 - beta2**step) / (1 - beta1**step)
    p.sub_(step_size * coeff * update)
    return coeff


def run_reference(
    base: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    hps: list[dict[str, Any]],
    round_to: torch.dtype | None = None,
    grad_scale: float = 1.0,
) -> tuple[list[torch.Tensor], list[list[float]]]:
    """Steps float64 copies of base; hps[i] are param i's hyperparameters."""
    ps = [b.detach().double().clone() for b in base]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    coeffs = []
    for t, step_grads in enumerate(grads, 1):
        coeffs.append(
            [
                reference_lamb_step(p, g.double(), m, v, t, grad_scale, **hp)
                for p, g, m, v, hp in zip(ps, step_grads, ms, vs, hps)
            ]
        )
        if round_to is not None:  # what storing the params in round_to does
            for p in ps:
                p.copy_(p.to(round_to).double())
    return ps, coeffs


def run_ours(
    opt: FusedLamb, params: list[torch.Tensor], grads: list[list[torch.Tensor]], **step_kw: Any
) -> tuple[list[torch.Tensor], list[list[float]]]:
    coeffs = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        opt.step(**step_kw)
        coeffs.append(opt.get_lamb_coeffs())
    return [p.detach().double() for p in params], coeffs


def assert_params_close(
    ours: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype, lr: float = 0.0
) -> None:
    if dtype in (torch.float32, torch.float64):
        tol = dict(rtol=2e-5, atol=5e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-14)
        for o, r in zip(ours, ref):
            torch.testing.assert_close(o, r, **tol)
        return
    # 16-bit storage: an fp32 and a float64 evaluation may round a value sitting on a
    # rounding boundary differently, and the two runs then go on from neighbouring values
    # (the GPU's norms sum in another order than the CPU's, so it meets other boundaries).
    # Two ulps of the value, or of the step size (lr) for values that have since moved
    # towards zero; at most 0.1% of elements past that, by no more than four. A broken
    # kernel moves nearly every element.
    eps = torch.finfo(dtype).eps
    off = total = 0
    for o, r in zip(ours, ref):
        bound = 2 * eps * (r.abs() + lr)
        excess = (o - r).abs() - bound
        assert bool((excess <= bound).all()), f"{dtype}: off by more than 4 ulps"
        off += int((excess > 0).sum())
        total += o.numel()
    assert off <= max(1, total // 1000), f"{dtype}: {off} of {total} elements past 2 ulps"


def assert_coeffs_close(ours: list[list[float]], ref: list[list[float]], rtol: float = 1e-5):
    assert len(ours) == len(ref)
    for step, (o, r) in enumerate(zip(ours, ref)):
        assert o == pytest.approx(r, rel=rtol), f"lamb coeffs differ at step {step + 1}"


VARIANTS = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.01),
    dict(lr=5e-3, weight_decay=0.1, eps_inside_sqrt=True),
    dict(lr=1e-2, bias_correction=False, eps=1e-6),
    dict(lr=2e-2, betas=(0.5, 0.9), max_coeff=1.5, min_coeff=0.9),  # clamps both ways
]


@pytest.mark.parametrize("hp", VARIANTS, ids=lambda hp: ",".join(f"{k}={v}" for k, v in hp.items()))
def test_fp32_matches_reference(hp):
    base = make_params(torch.float32)  # odd sizes: (1,), (7,), (33,), (257, 129), (4099,) ...
    grads = make_grads(base, 25)
    ours = clone_params(base, torch.float32)
    got, got_coeffs = run_ours(FusedLamb(ours, **hp), ours, grads)
    ref, ref_coeffs = run_reference(base, grads, [hp] * len(base))
    assert_params_close(got, ref, torch.float32)
    assert_coeffs_close(got_coeffs, ref_coeffs)
    if "max_coeff" in hp:  # this variant exists to hit the clamp at both ends
        flat = [c for step in got_coeffs for c in step]
        assert min(flat) == pytest.approx(0.9) and max(flat) == pytest.approx(1.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_keep_fp32_states(dtype):
    hp = dict(lr=5e-2, weight_decay=0.01)  # large enough to move 16-bit params
    base = make_params(dtype)
    grads = [[g.to(dtype).float() for g in gs] for gs in make_grads(base, 20)]
    ours = clone_params(base, dtype)
    opt = FusedLamb(ours, **hp)
    got, got_coeffs = run_ours(opt, ours, grads)
    ref, ref_coeffs = run_reference(base, grads, [hp] * len(base), round_to=dtype)
    assert all(p.dtype == dtype for p in ours)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert_params_close(got, ref, dtype, lr=hp["lr"])
    assert_coeffs_close(got_coeffs, ref_coeffs, rtol=1e-4)


def test_float64_params_are_exact():
    base = make_params(torch.float64)
    grads = make_grads(base, 20)
    ours = clone_params(base, torch.float64)
    opt = FusedLamb(ours, lr=1e-2, weight_decay=0.05)
    got, got_coeffs = run_ours(opt, ours, grads)
    ref, ref_coeffs = run_reference(base, grads, [dict(lr=1e-2, weight_decay=0.05)] * len(base))
    assert_params_close(got, ref, torch.float64)
    assert_coeffs_close(got_coeffs, ref_coeffs, rtol=1e-12)


def test_param_groups_use_their_own_hyperparameters():
    base = make_params(torch.float32)
    grads = make_grads(base, 20)
    ours = clone_params(base, torch.float32)
    g0 = dict(lr=1e-2, weight_decay=0.0)
    g1 = dict(lr=3e-3, weight_decay=0.1, max_coeff=2.0)
    opt = FusedLamb([{"params": ours[:3], **g0}, {"params": ours[3:], **g1}], lr=1.0)
    got, got_coeffs = run_ours(opt, ours, grads)
    hps = [g0] * 3 + [g1] * (len(base) - 3)
    ref, ref_coeffs = run_reference(base, grads, hps)
    assert_params_close(got, ref, torch.float32)
    assert_coeffs_close(got_coeffs, ref_coeffs)


def test_zero_norms_give_coeff_one():
    # A zero param (w_norm = 0), and a param with zero grad and no decay (u_norm = 0).
    a = torch.nn.Parameter(torch.zeros(10))
    b = torch.nn.Parameter(torch.ones(10))
    opt = FusedLamb([a, b], lr=0.1, max_coeff=5.0, min_coeff=2.0)
    a.grad = torch.full((10,), 0.5)
    b.grad = torch.zeros(10)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0, 1.0]
    # With coeff 1, step 1: step_size = lr * sqrt(1 - beta2) / (1 - beta1), u = m / (sqrt(v) + eps).
    u = 0.05 / (math.sqrt(0.001 * 0.25) + 1e-8)
    expected = -0.1 * math.sqrt(0.001) / 0.1 * u
    torch.testing.assert_close(a.detach(), torch.full((10,), expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(b.detach(), torch.ones(10))


def test_params_without_grads_are_skipped():
    ps = clone_params(make_params(torch.float32, shapes=[(3,), (4,), (5,)]), torch.float32)
    opt = FusedLamb(ps, lr=1e-2)
    before = ps[1].detach().clone()
    ps[0].grad, ps[2].grad = torch.ones(3), torch.ones(5)
    opt.step()
    assert len(opt.get_lamb_coeffs()) == 2
    assert torch.equal(ps[1].detach(), before)
    assert ps[1] not in opt.state and opt.state[ps[0]]["step"] == 1


def test_loss_scale_and_max_grad_norm():
    base = make_params(torch.float32, shapes=[(33,), (7, 5)])
    grads = make_grads(base, 10)
    scale, max_norm = 8.0, 0.5
    ours = clone_params(base, torch.float32)
    opt = FusedLamb(ours, lr=1e-2, max_grad_norm=max_norm)
    for step_grads in grads:
        for p, g in zip(ours, step_grads):
            p.grad = g * scale
        # The norm of the still-scaled grads of the group, as a loss-scaling caller passes it.
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() * scale for g in step_grads])))
        opt.step(scale=scale, grad_norms=[norm])
    # Reference: grads divided by clip * scale, clip = (norm / scale + 1e-6) / max_norm.
    ref = [b.detach().double().clone() for b in base]
    ms, vs = [torch.zeros_like(r) for r in ref], [torch.zeros_like(r) for r in ref]
    for t, step_grads in enumerate(grads, 1):
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in step_grads])))
        clip = (norm + 1e-6) / max_norm
        combined = clip * scale if clip > 1 else scale
        for p, g, m, v in zip(ref, step_grads, ms, vs):
            reference_lamb_step(p, g.double() * scale, m, v, t, combined, lr=1e-2)
    assert_params_close([p.detach().double() for p in ours], ref, torch.float32)

    # Without grad_norms the group norm is computed: same result.
    again = clone_params(base, torch.float32)
    opt2 = FusedLamb(again, lr=1e-2, max_grad_norm=max_norm)
    for step_grads in grads:
        for p, g in zip(again, step_grads):
            p.grad = g * scale
        opt2.step(scale=scale)
    assert_params_close([p.detach().double() for p in again], ref, torch.float32)


def test_explicit_grads_and_output_params():
    base = make_params(torch.float32, shapes=[(9,), (4, 4)])
    grads = make_grads(base, 5)
    ours = clone_params(base, torch.float32)
    outs = [torch.empty(p.shape, dtype=torch.float16) for p in ours]
    opt = FusedLamb(ours, lr=1e-2)
    for step_grads in grads:
        opt.step(grads=[g.half() for g in step_grads], output_params=outs)  # upstream's fp16 grads
    ref, _ = run_reference(
        base, [[g.half().double() for g in gs] for gs in grads], [dict(lr=1e-2)] * 2
    )
    assert_params_close([p.detach().double() for p in ours], ref, torch.float32)
    for o, p in zip(outs, ours):
        assert torch.equal(o, p.detach().half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip_resumes_identically(dtype):
    state_dict_roundtrip(lambda ps: FusedLamb(ps, lr=1e-2, weight_decay=0.01), dtype)


def test_state_dict_keeps_fp32_moments_of_bf16_params():
    ps = clone_params(make_params(torch.bfloat16), torch.bfloat16)
    opt = FusedLamb(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = FusedLamb(ps, lr=1e-2)
    fresh.load_state_dict(saved)
    for p in ps:
        assert fresh.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert fresh.state[p]["step"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1.0),
        dict(betas=(1.0, 0.999)),
        dict(betas=(0.9, -0.1)),
        dict(eps=-1e-8),
        dict(weight_decay=-0.1),
        dict(max_grad_norm=-1.0),
        dict(min_coeff=-0.1),
        dict(min_coeff=2.0, max_coeff=1.0),
        dict(max_coeff=float("inf")),
        dict(lr=float("nan")),
    ],
)
def test_bad_hyperparameters_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        FusedLamb([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_bad_param_group_raises_value_error():
    opt = FusedLamb([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "betas": (0.9, 1.5)})


def test_amsgrad_is_rejected_like_upstream():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb([torch.nn.Parameter(torch.ones(3))], amsgrad=True)


def test_upstream_attributes():
    opt = FusedLamb([torch.nn.Parameter(torch.ones(3))], eps_inside_sqrt=True)
    assert opt.eps_mode == 0
    assert opt.get_lamb_coeffs() == []
    group_keys = {
        "lr",
        "bias_correction",
        "betas",
        "eps",
        "weight_decay",
        "max_grad_norm",
        "max_coeff",
        "min_coeff",
    }
    assert set(opt.defaults) == group_keys  # upstream's group keys, for its state_dicts

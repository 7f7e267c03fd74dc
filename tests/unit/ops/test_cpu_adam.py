"""DeepSpeedCPUAdam against torch.optim.AdamW / Adam (see [Note: kernel tolerance])."""

import pytest
import torch

from deepspeed_ext.ops.adam import DeepSpeedCPUAdam
from tests.helpers.optim_parity import (
    clone_params,
    make_grads,
    make_params,
    max_err,
    parity,
    run,
    state_dict_roundtrip,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adamw_mode_matches_torch_adamw(dtype, wd):
    parity(
        lambda ps: DeepSpeedCPUAdam(ps, lr=3e-3, weight_decay=wd, adamw_mode=True),
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=wd, foreach=False),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_mode_l2_matches_torch_adam(dtype):
    parity(
        lambda ps: DeepSpeedCPUAdam(ps, lr=2e-3, weight_decay=0.1, adamw_mode=False),
        lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.1, foreach=False),
        dtype,
    )


def test_fp32_grads_with_bf16_params():
    parity(
        lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0, foreach=False),
        torch.bfloat16,
        grad_dtype=torch.float32,
    )


def test_no_bias_correction_matches_formula():
    # torch has no switch for it: the reference is the Adam update with both corrections at 1.
    class NoBC(torch.optim.AdamW):
        def step(self):
            with torch.no_grad():
                for g in self.param_groups:
                    b1, b2 = g["betas"]
                    for p in g["params"]:
                        st = self.state.setdefault(p, {})
                        m = st.setdefault("m", torch.zeros_like(p))
                        v = st.setdefault("v", torch.zeros_like(p))
                        p.mul_(1 - g["lr"] * g["weight_decay"])
                        m.mul_(b1).add_(p.grad, alpha=1 - b1)
                        v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                        p.addcdiv_(m, v.sqrt().add_(g["eps"]), value=-g["lr"])

    parity(
        lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01, bias_correction=False),
        lambda ps: NoBC(ps, lr=1e-3, weight_decay=0.01),
        torch.float32,
    )


def test_param_groups_use_their_own_hyperparameters():
    base = make_params(torch.float32)
    grads = make_grads(base, 20)

    def groups(ps):
        return [
            {"params": ps[:3], "lr": 1e-2, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 1e-3, "betas": (0.8, 0.99)},
        ]

    ours = run(
        lambda ps: DeepSpeedCPUAdam(groups(ps), lr=5e-3), clone_params(base, torch.float32), grads
    )
    ref = run(
        lambda ps: torch.optim.AdamW(groups(ps), lr=5e-3, weight_decay=0.0, foreach=False),
        clone_params(base, torch.float32),
        grads,
    )
    assert max_err(ours, ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_roundtrip_resumes_identically(dtype):
    state_dict_roundtrip(lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01), dtype)


def test_states_are_fp32_for_bf16_params_and_param_dtype_when_asked():
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    p.grad = torch.randn(100).bfloat16()
    opt = DeepSpeedCPUAdam([p])
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    opt2 = DeepSpeedCPUAdam([q], fp32_optimizer_states=False)
    opt2.step()
    assert opt2.state[q]["exp_avg_sq"].dtype == torch.bfloat16
    # same first step up to bf16 rounding of the states
    assert torch.allclose(p.float(), q.float(), atol=1e-2)


def test_noncontiguous_param_is_updated_in_place():
    base = torch.randn(8, 6)
    p = torch.nn.Parameter(base.t())  # non-contiguous view
    ref = torch.nn.Parameter(base.t().contiguous())
    g = torch.randn(6, 8)
    p.grad, ref.grad = g.clone(), g.clone()
    DeepSpeedCPUAdam([p], lr=0.1).step()
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0).step()
    assert torch.allclose(p, ref, atol=1e-6)


def test_params_without_grad_are_left_alone():
    a, b = make_params(torch.float32, shapes=[(10,), (10,)])
    before = b.detach().clone()
    a.grad = torch.randn(10)
    opt = DeepSpeedCPUAdam([a, b])
    opt.step()
    assert torch.equal(b, before) and b not in opt.state


def test_bad_hyperparameters_name_the_value():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="lr=-1"):
        DeepSpeedCPUAdam(p, lr=-1)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.5"):
        DeepSpeedCPUAdam(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam(p, amsgrad=True)


def test_device_param_is_refused_with_a_fix():
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    p.grad = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match="offload_optimizer"):
        DeepSpeedCPUAdam([p]).step()


def test_bf16_grads_with_fp32_params():
    # ZeRO's fp32 masters receive gradients accumulated in bf16 when grad_accum_dtype is bf16
    parity(
        lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
        torch.float32,
        grad_dtype=torch.bfloat16,
    )


def test_group_values_are_checked_before_any_state_moves():
    """A param group's amsgrad was ignored (plain Adam ran), its lr of -1 failed inside the
    kernel after the step count moved (bias correction a step off), and lr 1e31 passed the
    constructor only to fail at step()."""
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="amsgrad"):
        w.grad = torch.ones(3)
        DeepSpeedCPUAdam([{"params": [w], "amsgrad": True}]).step()
    opt = DeepSpeedCPUAdam([w], lr=0.1)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr=-1"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert opt.state[w]["step"] == 1
    with pytest.raises(ValueError, match=r"lr=1e\+31"):
        DeepSpeedCPUAdam([w], lr=1e31)


def test_a_torch_state_of_a_transposed_param_resumes():
    """torch keeps a transposed param's moments in its strides; the kernel refused them at
    the next step ('exp_avgs[0] is not contiguous')."""
    base = torch.randn(4, 3)
    a = torch.nn.Parameter(base.t().contiguous().t())  # shape (3, 4), strides of a transpose
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=0.1, foreach=False)
    a.grad = torch.ones_like(a)
    ref.step()
    ours = DeepSpeedCPUAdam([b], lr=0.1)
    b.data.copy_(a.detach())
    ours.load_state_dict(ref.state_dict())
    for p in (a, b):
        p.grad = torch.full_like(p, 0.5)
    ref.step()
    ours.step()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_a_huge_gradient_still_steps():
    """g * g overflowed fp32 for |g| above ~1.8e19 (torch scales by 1 - beta2 first): v was
    inf and the step did nothing."""
    a = torch.nn.Parameter(torch.ones(1))
    b = torch.nn.Parameter(torch.ones(1))
    for p in (a, b):
        p.grad = torch.full((1,), 2e19)
    torch.optim.AdamW([a], lr=0.1, weight_decay=0.0, foreach=False).step()
    opt = DeepSpeedCPUAdam([b], lr=0.1, weight_decay=0.0)
    opt.step()
    assert torch.isfinite(opt.state[b]["exp_avg_sq"]).all()
    torch.testing.assert_close(b, a)

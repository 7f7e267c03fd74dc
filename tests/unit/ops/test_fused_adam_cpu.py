"""FusedAdam on CPU tensors (the cpu_adam kernel path) against torch.optim."""

import pytest
import torch

from deepspeed_ext.ops.adam import FusedAdam
from tests.helpers.optim_parity import parity, state_dict_roundtrip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch(dtype, adam_w_mode):
    ref = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    parity(
        lambda ps: FusedAdam(ps, lr=2e-3, weight_decay=0.05, adam_w_mode=adam_w_mode),
        lambda ps: ref(ps, lr=2e-3, weight_decay=0.05, foreach=False),
        dtype,
    )


def test_state_dict_roundtrip():
    state_dict_roundtrip(lambda ps: FusedAdam(ps, lr=1e-3), torch.float32)


def test_amsgrad_and_legacy_step_args_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    p[0].grad = torch.zeros(2)
    with pytest.raises(RuntimeError, match="closure"):
        FusedAdam(p).step(grads=[torch.zeros(2)])


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_a_torch_adam_state_dict_resumes_in_fused_adam(adam_w_mode: bool) -> None:
    """A run switching optimizers on resume: FusedAdam takes torch's per-param steps and
    moments, and goes on as torch's own optimizer would (bias correction included)."""
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(33))
    b = torch.nn.Parameter(a.detach().clone())
    ref = ref_cls([a], lr=1e-2, weight_decay=0.1, foreach=False)
    grads = [torch.randn(33) for _ in range(5)]
    for g in grads[:3]:
        a.grad = g.clone()
        ref.step()
    b.data.copy_(a.detach())
    fused = FusedAdam([b], lr=1.0, weight_decay=0.0, adam_w_mode=adam_w_mode)
    fused.load_state_dict(ref.state_dict())  # the saved options win over the constructor's
    assert fused.param_groups[0]["step"] == 3 and fused.param_groups[0]["bias_correction"]
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        fused.step()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)

"""DeepSpeedCPULion against a reference Lion written here (Chen et al. 2023, Algorithm 2)."""

import pytest
import torch

from deepspeed_ext.ops.lion import DeepSpeedCPULion
from tests.helpers.optim_parity import parity, state_dict_roundtrip


class ReferenceLion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_reference_lion(dtype, wd):
    parity(
        lambda ps: DeepSpeedCPULion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=wd),
        lambda ps: ReferenceLion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=wd),
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip(dtype):
    state_dict_roundtrip(lambda ps: DeepSpeedCPULion(ps, lr=1e-4, weight_decay=0.1), dtype)


def test_zero_direction_leaves_param_unchanged():
    # sign(0) = 0: a zero gradient on a zero momentum must not move the parameter.
    p = torch.nn.Parameter(torch.ones(37))
    p.grad = torch.zeros(37)
    DeepSpeedCPULion([p], lr=0.1).step()
    assert torch.equal(p.detach(), torch.ones(37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lion_on_cpu_params_matches_reference(dtype):
    # FusedLion (upstream's CUDA optimizer) takes CPU params through the cpu_lion op
    from deepspeed_ext.ops.lion import FusedLion

    parity(
        lambda ps: FusedLion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
        lambda ps: ReferenceLion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
        dtype,
    )


def test_lion_config_builds_fused_lion_for_device_params():
    from deepspeed_ext.ops.lion import FusedLion
    from deepspeed_ext.runtime.optimizers import build_optimizer

    p = torch.nn.Parameter(torch.zeros(3))
    assert isinstance(build_optimizer("lion", [p], {"lr": 1e-3}, on_cpu=False), FusedLion)
    assert isinstance(build_optimizer("lion", [p], {"lr": 1e-3}, on_cpu=True), DeepSpeedCPULion)

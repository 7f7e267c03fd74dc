"""FusedLion's CUDA kernel ([Note: fused lion math]) against the reference Lion of
test_cpu_lion (the paper's Algorithm 2) in float64, within twice torch's own fp32 error; many
tensors across launch tables and chunks; misaligned views; the binding's input checks; the
`lion` config optimizer on CUDA params. Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.lion import FusedLion
from deepspeed_ext.runtime.optimizers import build_optimizer
from tests.helpers.optim_parity import (
    assert_within_twice_torch,
    clone_params,
    make_grads,
    make_params,
    run,
)
from tests.unit.ops.test_cpu_lion import ReferenceLion
from tests.unit.ops.test_fused_cuda import MANY_SHAPES, run_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"


def lion_parity(dtype: torch.dtype, wd: float, grad_dtype=None, shapes=None) -> None:
    base = make_params(dtype) if shapes is None else make_params(dtype, shapes=shapes)
    gd = grad_dtype or dtype
    grads = [[g.to(gd).float() for g in gs] for gs in make_grads(base, 25)]
    rounding = None if dtype == torch.float32 else dtype
    ours = lambda ps: FusedLion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=wd)  # noqa: E731
    ref = lambda ps: ReferenceLion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=wd)  # noqa: E731
    got, _ = run_cuda(ours, base, grads, dtype, gd)
    own = run(ref, clone_params(base, torch.float32), grads, round_to=rounding)
    truth = run(ref, clone_params(base, torch.float64), grads, round_to=rounding)
    assert_within_twice_torch(got, own, truth, storage=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fused_lion_matches_reference(dtype, wd):
    lion_parity(dtype, wd)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_lion_fp32_grads_with_16bit_params(dtype):
    lion_parity(dtype, 0.05, grad_dtype=torch.float32)


def test_fused_lion_many_tensors_and_chunks():
    lion_parity(torch.float32, 0.01, shapes=MANY_SHAPES)


def test_fused_lion_misaligned_views_and_zero_direction():
    storage = torch.randn(1000 + 35, device=DEV)
    views = [storage[1:34], storage[35:1035]]  # odd offsets: not 16-byte aligned
    ours = [torch.nn.Parameter(v) for v in views]
    ref = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opt_a = FusedLion(ours, lr=1e-2, betas=(0.9, 0.99))  # the reference's betas, not defaults
    opt_b = ReferenceLion(ref, lr=1e-2, betas=(0.9, 0.99))
    for g in make_grads([v.cpu() for v in views], 5):
        for p, q, x in zip(ours, ref, g):
            p.grad, q.grad = x.to(DEV), x.to(DEV)
        opt_a.step()
        opt_b.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    still = torch.nn.Parameter(torch.ones(37, device=DEV))
    still.grad = torch.zeros(37, device=DEV)
    FusedLion([still], lr=0.1).step()  # sign(0) = 0: no move
    assert torch.equal(still.detach(), torch.ones(37, device=DEV))


def _op() -> Any:
    from deepspeed_ext.op_builder.fused_lion import FusedLionBuilder

    return FusedLionBuilder().load()


@pytest.mark.parametrize(
    "bad, hp, message",
    [
        (None, dict(beta1=1.0), "beta1"),
        (None, dict(beta2=-0.5), "beta2"),
        (None, dict(lr=float("nan")), "lr"),
        (None, dict(wd=-1.0), "weight_decay"),
        (("grads", 1, lambda: torch.randn(5)), {}, r"grads\[1\] must be a CUDA tensor"),
        (("exp_avgs", 0, lambda: torch.zeros(6, device=DEV)), {}, r"exp_avgs\[0\] has 6"),
        (("exp_avgs", 1, lambda: torch.zeros(5, device=DEV).half()), {}, r"exp_avgs\[1\] must"),
        (("params", 0, lambda: torch.randn(5, device=DEV).double()), {}, r"params\[0\] must be"),
    ],
)
def test_binding_checks_its_inputs(bad, hp, message):
    lists = {
        "params": [torch.randn(5, device=DEV) for _ in range(2)],
        "grads": [torch.randn(5, device=DEV) for _ in range(2)],
        "exp_avgs": [torch.zeros(5, device=DEV) for _ in range(2)],
    }
    if bad is not None:
        key, i, make = bad
        lists[key][i] = make()
    h = {**dict(lr=1e-3, beta1=0.9, beta2=0.99, wd=0.0), **hp}
    with pytest.raises(RuntimeError, match=message):
        _op().multi_tensor_lion(
            lists["params"],
            lists["grads"],
            lists["exp_avgs"],
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["wd"],
        )


def test_lion_config_on_cuda_params_is_fused_lion():
    p = torch.nn.Parameter(torch.randn(4, device=DEV))
    opt = build_optimizer("lion", [p], {"lr": 1e-3, "weight_decay": 0.01}, on_cpu=False)
    assert isinstance(opt, FusedLion)

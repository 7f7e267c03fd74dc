"""The fused CUDA optimizers: FusedAdam against torch.optim (see [Note: kernel tolerance]) and
FusedLamb against the float64 reference of test_fused_lamb. Skipped without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.adam import FusedAdam
from deepspeed_ext.ops.lamb import FusedLamb
from tests.helpers.optim_parity import (
    assert_within_twice_torch,
    clone_params,
    make_grads,
    make_params,
    run,
)
from tests.unit.ops.test_fused_lamb import (
    assert_coeffs_close,
    assert_params_close,
    reference_lamb_step,
    run_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Past one launch table (74 tensors for Adam, 63 for LAMB), several chunks of 65536, odd
# sizes for the vector tails, and an empty tensor.
MANY_SHAPES = [(i % 37 + 1, 3) for i in range(150)] + [(3 * 65536 + 5,), (0,), (1,)]


def run_cuda(
    make_opt: Callable[[list[torch.nn.Parameter]], Any],
    base: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    dtype: torch.dtype,
    grad_dtype: torch.dtype | None = None,
    step_kw: dict[str, Any] | None = None,
) -> tuple[list[torch.Tensor], list[list[float]]]:
    """Steps make_opt over CUDA copies of base; returns float64 CPU params (and LAMB coeffs)."""
    params = [torch.nn.Parameter(b.detach().to(DEV, dtype)) for b in base]
    opt = make_opt(params)
    coeffs = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            gd = grad_dtype or dtype
            if gd != dtype and hasattr(p, "grad_dtype"):
                p.grad_dtype = None  # torch >= 2.10: opt in to grads of another dtype
            p.grad = g.to(DEV, gd)
        opt.step(**(step_kw or {}))
        if isinstance(opt, FusedLamb):
            coeffs.append(opt.get_lamb_coeffs())
    return [p.detach().cpu().double() for p in params], coeffs


# -- FusedAdam ------------------------------------------------------------------------------------


def adam_parity(ours: Any, reference: Any, dtype: torch.dtype, grad_dtype=None, shapes=None):
    base = make_params(dtype) if shapes is None else make_params(dtype, shapes=shapes)
    gd = grad_dtype or dtype
    grads = [[g.to(gd).float() for g in gs] for gs in make_grads(base, 25)]
    rounding = None if dtype == torch.float32 else dtype
    got, _ = run_cuda(ours, base, grads, dtype, gd)
    own = run(reference, clone_params(base, torch.float32), grads, round_to=rounding)
    ref = run(reference, clone_params(base, torch.float64), grads, round_to=rounding)
    assert_within_twice_torch(got, own, ref, storage=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_fused_adam_adamw_mode_matches_torch_adamw(dtype, wd):
    adam_parity(
        lambda ps: FusedAdam(ps, lr=3e-3, weight_decay=wd, adam_w_mode=True),
        lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=wd, foreach=False),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_adam_l2_mode_matches_torch_adam(dtype):
    adam_parity(
        lambda ps: FusedAdam(ps, lr=2e-3, weight_decay=0.1, adam_w_mode=False),
        lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.1, foreach=False),
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_adam_fp32_grads_with_16bit_params(dtype):
    adam_parity(
        lambda ps: FusedAdam(ps, lr=1e-3),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0, foreach=False),
        dtype,
        grad_dtype=torch.float32,
    )


def test_fused_adam_many_tensors_and_chunks():
    adam_parity(
        lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
        torch.float32,
        shapes=MANY_SHAPES,
    )


def test_fused_adam_misaligned_tensors_take_the_scalar_path():
    # Views at an odd element offset: contiguous, but not 16-byte aligned.
    sizes = [33, 1000, 4099]
    storage = torch.randn(sum(sizes) + len(sizes), device=DEV)
    views, start = [], 1
    for n in sizes:
        views.append(storage[start : start + n])
        start += n + 1
    ours = [torch.nn.Parameter(v) for v in views]
    ref = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opt_a = FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    opt_b = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for g in make_grads([v.cpu() for v in views], 10):
        for p, q, x in zip(ours, ref, g):
            p.grad = x.to(DEV)
            q.grad = x.to(DEV)
        opt_a.step()
        opt_b.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


# -- FusedLamb ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hp",
    [dict(lr=1e-2, weight_decay=0.01), dict(lr=5e-3, eps_inside_sqrt=True, bias_correction=False)],
    ids=["default_eps", "eps_inside_sqrt"],
)
def test_fused_lamb_matches_reference(dtype, hp):
    if dtype != torch.float32:
        hp = {**hp, "lr": 5e-2}  # large enough to move 16-bit params
    base = make_params(dtype)
    grads = [[g.to(dtype).float() for g in gs] for gs in make_grads(base, 20)]
    got, got_coeffs = run_cuda(lambda ps: FusedLamb(ps, **hp), base, grads, dtype)
    ref, ref_coeffs = run_reference(
        base, grads, [hp] * len(base), round_to=None if dtype == torch.float32 else dtype
    )
    assert_params_close(got, ref, dtype, lr=hp["lr"])
    assert_coeffs_close(got_coeffs, ref_coeffs, rtol=1e-5 if dtype == torch.float32 else 1e-4)


def test_fused_lamb_many_tensors_and_chunks():
    hp = dict(lr=1e-2, weight_decay=0.01, max_coeff=2.0, min_coeff=0.5)
    base = make_params(torch.float32, shapes=MANY_SHAPES)
    grads = make_grads(base, 5)
    got, got_coeffs = run_cuda(lambda ps: FusedLamb(ps, **hp), base, grads, torch.float32)
    ref, ref_coeffs = run_reference(base, grads, [hp] * len(base))
    assert_params_close(got, ref, torch.float32)
    assert_coeffs_close(got_coeffs, ref_coeffs)


def test_fused_lamb_fp16_grads_fp32_params_and_output_params():
    base = make_params(torch.float32, shapes=[(9,), (64, 33)])
    grads = make_grads(base, 5)
    params = [torch.nn.Parameter(b.to(DEV)) for b in base]
    outs = [torch.empty(p.shape, dtype=torch.float16, device=DEV) for p in params]
    opt = FusedLamb(params, lr=1e-2)
    for gs in grads:
        opt.step(grads=[g.to(DEV, torch.float16) for g in gs], output_params=outs)
    ref, _ = run_reference(
        base, [[g.half().double() for g in gs] for gs in grads], [{"lr": 1e-2}] * 2
    )
    assert_params_close([p.detach().cpu().double() for p in params], ref, torch.float32)
    for o, p in zip(outs, params):
        assert torch.equal(o, p.detach().half())


def test_fused_lamb_op_keeps_coeff_order_across_dtypes_and_is_deterministic():
    op = _lamb_op()
    shapes = [(7,), (300,), (5, 5), (70000,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float32]
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]

    def one_step() -> tuple[list[torch.Tensor], torch.Tensor]:
        ps = [h.to(DEV, d) for h, d in zip(host, dtypes)]
        gs = [g.to(DEV, d) for g, d in zip(grads, dtypes)]
        ms = [torch.zeros(s, device=DEV) for s in shapes]
        vs = [torch.zeros(s, device=DEV) for s in shapes]
        c = op.multi_tensor_lamb(
            ps, gs, ms, vs, 1e-2, 0.9, 0.999, 1e-8, 1, True, 0.01, False, 1.0, 10.0, 0.01
        )
        return ps, c

    ps, coeffs = one_step()
    expected = []
    for h, g, d in zip(host, grads, dtypes):
        p64 = h.to(d).double()
        m, v = torch.zeros_like(p64), torch.zeros_like(p64)
        expected.append(
            reference_lamb_step(p64, g.to(d).double(), m, v, 1, lr=1e-2, weight_decay=0.01)
        )
    assert coeffs.tolist() == pytest.approx(expected, rel=1e-4)
    ps2, coeffs2 = one_step()
    assert torch.equal(coeffs, coeffs2)
    assert all(torch.equal(a, b) for a, b in zip(ps, ps2))


# -- input checks of the bindings -----------------------------------------------------------------


def _lamb_op() -> Any:
    from deepspeed_ext.op_builder.fused_lamb import FusedLambBuilder

    return FusedLambBuilder().load()


def _adam_op() -> Any:
    from deepspeed_ext.op_builder.fused_adam import FusedAdamBuilder

    return FusedAdamBuilder().load()


def _lists(n: int = 2, **overrides: Any) -> dict[str, list[torch.Tensor]]:
    """Valid op inputs, with overrides[key] = (index, factory of the tensor to put there)."""
    lists = {
        "params": [torch.randn(5, device=DEV) for _ in range(n)],
        "grads": [torch.randn(5, device=DEV) for _ in range(n)],
        "exp_avgs": [torch.zeros(5, device=DEV) for _ in range(n)],
        "exp_avg_sqs": [torch.zeros(5, device=DEV) for _ in range(n)],
    }
    for key, (i, make) in overrides.items():
        lists[key][i] = make()
    return lists


def _call(kind: str, lists: dict[str, list[torch.Tensor]], **hp: Any) -> None:
    args = [lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"]]
    h = {**dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1, wd=0.0), **hp}
    if kind == "adam":
        _adam_op().multi_tensor_adam(
            *args, h["lr"], h["beta1"], h["beta2"], h["eps"], h["step"], True, True, h["wd"]
        )
    else:
        _lamb_op().multi_tensor_lamb(
            *args,
            h["lr"],
            h["beta1"],
            h["beta2"],
            h["eps"],
            h["step"],
            True,
            h["wd"],
            False,
            1.0,
            10.0,
            0.01,
        )


@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize(
    "lists, hp, message",
    [
        (dict(), dict(beta1=1.0), "beta1"),
        (dict(), dict(beta2=-0.5), "beta2"),
        (dict(), dict(eps=-1.0), "eps"),
        (dict(), dict(step=0), "step"),
        (dict(), dict(lr=-1.0), "lr"),
        (dict(grads=(1, lambda: torch.randn(5))), {}, r"grads\[1\] must be a CUDA tensor"),
        (dict(exp_avgs=(0, lambda: torch.zeros(6, device=DEV))), {}, r"exp_avgs\[0\] has 6"),
        (dict(exp_avg_sqs=(1, lambda: torch.zeros(5, device=DEV).half())), {}, r"exp_avg_sqs\[1\]"),
        (dict(params=(1, lambda: torch.randn(5, 2, device=DEV).t())), {}, r"params\[1\] must be c"),
        (dict(params=(0, lambda: torch.randn(5, device=DEV).double())), {}, r"params\[0\] must be"),
    ],
)
def test_bindings_check_their_inputs(kind, lists, hp, message):
    with pytest.raises(RuntimeError, match=message):
        _call(kind, _lists(**lists), **hp)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_bindings_check_list_lengths(kind):
    lists = _lists()
    lists["exp_avgs"] = lists["exp_avgs"][:1]
    with pytest.raises(RuntimeError, match="exp_avgs has 1 tensors but params has 2"):
        _call(kind, lists)

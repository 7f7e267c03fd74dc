"""The transformer op's kernels one by one: each against torch on the same inputs, the dropout
mask against its definition built in torch ops, and the binding's input checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepspeed_ext.ops.transformer import dropout_keep_mask
from deepspeed_ext.ops.transformer.kernels import CPUKernels, TorchKernels, op

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the same inputs every run


def test_dropout_mask_is_its_definition_and_keeps_one_minus_p():
    x = torch.ones(50_000)
    for p, seed, offset in ((0.1, 3, 0), (0.5, 2**40 + 5, 12345), (0.0, 1, 1)):
        out = op().dropout(x, p, seed, offset)
        keep = dropout_keep_mask(x.numel(), p, seed, offset)
        assert torch.equal(out != 0, keep)
        torch.testing.assert_close(out[keep], torch.full_like(out[keep], 1 / (1 - p)))
        assert abs(float(keep.float().mean()) - (1 - p)) < 0.01
    assert not op().dropout(x, 1.0, 1, 0).any()
    # offsets address one stream: two calls at adjacent offsets are one call split in two
    a = op().dropout(x[:1000], 0.3, 9, 100)
    b = op().dropout(x[:1000], 0.3, 9, 1100)
    assert torch.equal(torch.cat([a, b]), op().dropout(x[:2000], 0.3, 9, 100))


def test_dropout_masks_show_no_pattern():
    """Four elements share one 64-bit draw ([Note: replayed dropout]): neighbours within a
    draw, neighbouring draws and neighbouring seeds must still decide independently."""
    n = 1 << 18
    a = dropout_keep_mask(n, 0.5, 7, 0).float() * 2 - 1  # +-1, mean ~0
    b = dropout_keep_mask(n, 0.5, 8, 0).float() * 2 - 1
    bound = 4 / n**0.5  # 4 standard deviations of a mean of n independent +-1
    for lag in (1, 2, 3, 4, 5, 8):
        assert abs(float((a[:-lag] * a[lag:]).mean())) < bound, lag
    assert abs(float((a * b).mean())) < bound
    assert abs(float(a.mean())) < bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("invertible", [False, True])
def test_layer_norm_forward_and_backward(dtype, invertible):
    x = (torch.randn(37, 24) * 3 + 5).to(dtype)
    g = (torch.rand(24) + 0.5).to(dtype)
    b = torch.randn(24).to(dtype)
    dy = torch.randn(37, 24).to(dtype)
    y, mean, rstd = op().layer_norm_fwd(x, g, b, 1e-5)
    xr, gr, br = (t.double().requires_grad_() for t in (x, g, b))
    ref = F.layer_norm(xr, (24,), gr, br, 1e-5)
    ref.backward(dy.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.double(), ref.detach(), **tol)
    dx, dg, db = op().layer_norm_bwd(dy, y if invertible else x, invertible, g, b, mean, rstd)
    big = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(dx.double(), xr.grad, **big)
    torch.testing.assert_close(dg.double(), gr.grad, **big)
    torch.testing.assert_close(db.double(), br.grad, **big)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_matches_torch_tanh_gelu(dtype):
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(9, 40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    xr = (x.double() + bias.double()).requires_grad_()
    ref = F.gelu(xr, approximate="tanh")
    dy = torch.randn(9, 40, generator=g).to(dtype)
    ref.backward(dy.double())
    # the kernel's tanh is a polynomial exp (~1e-7 absolute), which the gradient scales by
    # about u * dy: over 200 seeds the worst excess was 2.6e-6
    tol = dict(rtol=1e-5, atol=5e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(op().bias_gelu_fwd(x, bias).double(), ref.detach(), **tol)
    torch.testing.assert_close(op().bias_gelu_bwd(dy, x, bias).double(), xr.grad, **tol)


@pytest.mark.parametrize("mq", [0, 1, 6])
def test_softmax_with_masks_and_its_backward(mq):
    scores = torch.randn(2, 3, 6, 5)
    mask = None if mq == 0 else torch.randn(2, mq, 5)
    sr = scores.double().requires_grad_()
    z = sr * 0.5 + (0 if mask is None else mask.double()[:, None])
    ref = torch.softmax(z, -1)
    dp = torch.randn_like(scores)
    ref.backward(dp.double())
    probs = op().softmax_fwd(scores, mask, 0.5)
    torch.testing.assert_close(probs.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    ds = op().softmax_bwd(dp, probs, 0.5)
    torch.testing.assert_close(ds.double(), sr.grad, rtol=1e-4, atol=1e-6)


def test_a_fully_masked_row_attends_to_nothing():
    scores = torch.randn(1, 1, 2, 4)
    mask = torch.zeros(1, 2, 4)
    mask[0, 1] = float("-inf")
    for k in (CPUKernels, TorchKernels):
        probs = k.softmax_fwd(scores, mask, 1.0)
        assert torch.equal(probs[0, 0, 1], torch.zeros(4)), k  # not NaN
        torch.testing.assert_close(probs[0, 0, 0].sum(), torch.tensor(1.0))


def test_a_row_holding_a_nan_is_nan_as_in_torch():
    scores = torch.randn(1, 1, 3, 4)
    scores[0, 0, 1, 2] = float("nan")
    scores[0, 0, 2] = float("nan")  # every score of the row
    for k in (CPUKernels, TorchKernels):
        probs = k.softmax_fwd(scores, None, 1.0)
        assert bool(probs[0, 0, 1:].isnan().all()), k
        torch.testing.assert_close(probs[0, 0, 0].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_kernels_match_the_cpu_op(dtype):
    """The path non-CPU tensors take is the same math as the op."""
    x, res = torch.randn(6, 16).to(dtype), torch.randn(6, 16).to(dtype)
    g, b = (torch.rand(16) + 0.5).to(dtype), torch.randn(16).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for name, args in (
        ("layer_norm_fwd", (x, g, b, 1e-6)),
        ("bias_gelu_fwd", (x, b)),
        ("bias_gelu_bwd", (res, x, b)),
        ("bias_dropout_residual", (x, b, res, 0.25, 11, 7)),
        ("dropout", (x, 0.25, 11, 7)),
    ):
        a, t = getattr(CPUKernels, name)(*args), getattr(TorchKernels, name)(*args)
        for u, v in zip(a if isinstance(a, tuple) else (a,), t if isinstance(t, tuple) else (t,)):
            torch.testing.assert_close(u.float(), v.float(), **tol, msg=name)
    y, mean, rstd = CPUKernels.layer_norm_fwd(x, g, b, 1e-6)
    dy = torch.randn(6, 16).to(dtype)
    for u, v in zip(
        CPUKernels.layer_norm_bwd(dy, x, False, g, b, mean, rstd),
        TorchKernels.layer_norm_bwd(dy, x, False, g, b, mean, rstd),
    ):
        torch.testing.assert_close(
            u.float(), v.float(), **dict(tol, atol=5e-2 if dtype != torch.float32 else 1e-4)
        )
    assert math.isfinite(float(rstd.sum()))


def test_the_binding_checks_its_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"gamma has shape \[7\]; expected \[8\]"):
        op().layer_norm_fwd(x, torch.ones(7), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match="bias has dtype BFloat16 but the input has Float"):
        op().bias_gelu_fwd(x, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"dropout p must be in \[0, 1\], got 1.5"):
        op().dropout(x, 1.5, 0, 0)
    with pytest.raises(RuntimeError, match="x has dtype Double"):
        op().dropout(x.double(), 0.1, 0, 0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        op().bias_gelu_fwd(x.t(), torch.zeros(4))
    with pytest.raises(
        RuntimeError, match=r"mask has shape \[2, 3, 5\]; expected \[2, 1 or 6, 5\]"
    ):
        op().softmax_fwd(torch.randn(2, 3, 6, 5), torch.zeros(2, 3, 5), 1.0)
    with pytest.raises(RuntimeError, match=r"mean and rstd .* of 4 elements"):
        op().layer_norm_bwd(
            x, x, False, torch.ones(8), torch.zeros(8), torch.zeros(3), torch.ones(4)
        )


def test_the_layer_op_checks_its_inputs():
    h, inter = 8, 32
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (inter, h), (inter,), (h, inter)]
    params = [torch.randn(s) for s in shapes + [(h,), (h,), (h,)]]
    x = torch.randn(2, 3, h)
    opts = (2, 0.1, 0.1, 1e-5, 0, 0, 100, 200, True, False, False, False)
    out, saved = op().layer_fwd(x, None, params, *opts, True)
    assert out.shape == x.shape and saved
    with pytest.raises(RuntimeError, match=r"inter_b has shape \[31\]; expected \[32\]"):
        op().layer_fwd(x, None, params[:7] + [torch.randn(31)] + params[8:], *opts, False)
    with pytest.raises(RuntimeError, match="expected 12 parameters, got 11"):
        op().layer_fwd(x, None, params[:11], *opts, False)
    with pytest.raises(RuntimeError, match="hidden size 8 is not divisible by heads 3"):
        op().layer_fwd(x, None, params, 3, *opts[1:], False)
    with pytest.raises(RuntimeError, match="attn_ow has dtype"):
        op().layer_fwd(x, None, params[:2] + [params[2].double()] + params[3:], *opts, False)
    with pytest.raises(RuntimeError, match="dropout p must be in"):
        op().layer_fwd(x, None, params, 2, 1.5, *opts[2:], False)
    # backward with saved tensors of other options (gelu_checkpoint keeps one fewer)
    with pytest.raises(RuntimeError, match="saved tensors; these options keep"):
        op().layer_bwd(out, saved, params, *opts[:10], True, False)
    dx, grads = op().layer_bwd(torch.ones_like(out), saved, params, *opts)
    assert dx.shape == x.shape and [g.shape for g in grads] == [p.shape for p in params]

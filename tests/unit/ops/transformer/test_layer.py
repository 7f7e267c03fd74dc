"""DeepSpeedTransformerLayer against a plain-torch BERT layer with the same weights: forward,
the input gradient and every parameter gradient, pre-LN and post-LN, with masks, with dropout
(masks replayed), with the memory options, in fp32 and 16-bit. Every test runs both ways the
layer computes: the compiled layer op (CPU and CUDA tensors) and the autograd functions over
torch ops (the fallback where no op builds)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.ops.transformer import (
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    functions,
    kernels,
    layer,
)

from .reference import NAMES, bert_layer, next_masks, params_of

B, S, H, HEADS = 2, 12, 32, 4


@pytest.fixture(autouse=True, params=["layer_op", "torch_ops"])
def path(request, monkeypatch):
    """Which way the layer computes: the compiled op, or the torch-op fallback."""
    if request.param == "torch_ops":
        torch_only = lambda t: kernels.TorchKernels  # noqa: E731
        monkeypatch.setattr(layer, "kernels_for", torch_only)
        monkeypatch.setattr(functions, "kernels_for", torch_only)
    return request.param


def make_layer(pre_ln=True, p_attn=0.0, p_hid=0.0, dtype=torch.float32, **kw):
    cfg = DeepSpeedTransformerConfig(
        batch_size=4,
        hidden_size=H,
        heads=HEADS,
        attn_dropout_ratio=p_attn,
        hidden_dropout_ratio=p_hid,
        num_hidden_layers=2,
        initializer_range=0.2,  # large enough that attention is far from uniform
        pre_layer_norm=pre_ln,
        seed=7,
        **kw,
    )
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(cfg)
    with torch.no_grad():  # non-trivial LayerNorm and bias values
        for n in NAMES:
            if n.endswith("b") or n in ("attn_nw", "norm_w"):
                getattr(layer, n).add_(torch.randn_like(getattr(layer, n)) * 0.1)
    return layer.to(dtype)


def make_mask(kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    m = torch.zeros(B, 1, 1, S)
    m[0, ..., -3:] = -10000.0  # HF's extended key-padding mask
    if kind == "full":
        m = m.expand(B, 1, S, S).clone()
        m[1, 0, 2, :5] = -10000.0
    return m


def run_ours(layer, x, mask):
    x = x.detach().clone().requires_grad_()
    out = layer(x, mask)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    grads = {n: getattr(layer, n).grad.clone() for n in NAMES}
    return out.detach(), x.grad, grads, g


def run_ref(layer, x, mask, g, dtype, drop=None):
    p = params_of(layer, dtype)
    xr = x.detach().to(dtype).requires_grad_()
    c = layer.config
    out = bert_layer(p, xr, mask, c.heads, c.pre_layer_norm, c.layer_norm_eps, drop)
    out.backward(g.to(dtype))
    return out.detach(), xr.grad, {n: p[n].grad for n in NAMES}


def assert_all_close(ours, ref, **tol):
    out, dx, grads = ours
    r_out, r_dx, r_grads = ref
    torch.testing.assert_close(out, r_out.to(out.dtype), **tol)
    torch.testing.assert_close(dx, r_dx.to(dx.dtype), **tol)
    for n in NAMES:
        torch.testing.assert_close(grads[n], r_grads[n].to(grads[n].dtype), **tol, msg=n)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre_ln", "post_ln"])
@pytest.mark.parametrize("mask_kind", ["none", "key", "full"])
def test_matches_plain_torch_layer(pre_ln, mask_kind):
    layer = make_layer(pre_ln)
    x = torch.randn(B, S, H)
    mask = make_mask(mask_kind)
    out, dx, grads, g = run_ours(layer, x, mask)
    assert_all_close(
        (out, dx, grads), run_ref(layer, x, mask, g, torch.float32), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_a_tokenizers_0_1_mask_masks_the_padded_keys(dtype):
    """As BertSparseSelfAttention reads it: 1 attend, 0 masked (added as a bias it masked
    nothing)."""
    layer = make_layer(True)
    x = torch.randn(B, S, H)
    keep = torch.ones(B, S, dtype=torch.long)
    keep[0, -3:] = 0
    additive = torch.zeros(B, 1, 1, S).masked_fill(keep[:, None, None, :] == 0, float("-inf"))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, keep.to(dtype)), layer(x, additive))
    if dtype != torch.bool:  # an integer additive mask (0 / -10000) is not read as 0/1
        with pytest.raises(ValueError, match="values other than 0 and 1"):
            layer(x, (keep - 1).to(dtype) * 10000)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre_ln", "post_ln"])
def test_dropout_matches_the_reference_with_the_same_masks(pre_ln):
    layer = make_layer(pre_ln, p_attn=0.2, p_hid=0.3)
    x, mask = torch.randn(B, S, H), make_mask("key")
    masks = next_masks(layer, B, S)
    keep = torch.cat([m.reshape(-1) for m in masks]).float().mean()
    assert 0.65 < float(keep) < 0.8  # about 1 - p of each
    out, dx, grads, g = run_ours(layer, x, mask)
    ref = run_ref(layer, x, mask, g, torch.float32, drop=(masks, 0.2, 0.3))
    assert_all_close((out, dx, grads), ref, rtol=1e-4, atol=1e-5)


def test_backward_replays_the_masks_and_forwards_draw_new_ones():
    layer = make_layer(p_attn=0.2, p_hid=0.2)
    x = torch.randn(B, S, H, requires_grad=True)
    out = layer(x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    out.sum().backward()
    assert torch.equal(x.grad, first)  # the second backward replays the same masks
    assert not torch.equal(layer(x), out)  # a new forward draws new masks
    layer.eval()
    assert torch.equal(layer(x), layer(x))  # no dropout in eval


@pytest.mark.parametrize(
    "option", ["normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint"]
)
def test_memory_options_keep_less_and_change_nothing(option):
    x, mask = torch.randn(B, S, H), make_mask("key")

    def saved_bytes_and_result(**kw):
        layer = make_layer(p_attn=0.2, p_hid=0.1, **kw)
        layer._seed = 1234  # the same masks in both layers (each layer's seed has its id added)
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        xi = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(xi, mask)
        out.square().sum().backward()
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        # bytes kept for backward beyond the parameters themselves (also saved)
        return sum(seen.values()) - params, (out, xi.grad, [p.grad for p in layer.parameters()])

    base_bytes, base = saved_bytes_and_result()
    opt_bytes, got = saved_bytes_and_result(**{option: True})
    assert opt_bytes < base_bytes, (option, opt_bytes, base_bytes)
    # the same math; invertible LayerNorm rounds x-hat differently (recomputed from y)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[0], base[0], **tol)
    torch.testing.assert_close(got[1], base[1], **tol)
    for a, b in zip(got[2], base[2]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre_ln", "post_ln"])
def test_16bit_within_twice_torchs_own_error(dtype, pre_ln):
    layer = make_layer(pre_ln, fp16=dtype == torch.float16)
    x, mask = torch.randn(B, S, H), make_mask("key")
    ours = run_ours(layer.to(dtype), x.to(dtype), mask)
    g = ours[3]
    ref64 = run_ref(layer, x, mask, g, torch.float64)
    torch16 = run_ref(layer, x, mask, g, dtype)
    for i, what in ((0, "output"), (1, "input grad")):
        e_ours = (ours[i].double() - ref64[i]).abs().max()
        e_torch = (torch16[i].double() - ref64[i]).abs().max()
        assert e_ours <= 2 * e_torch, (what, float(e_ours), float(e_torch))
    for n in NAMES:
        e_ours = (ours[2][n].double() - ref64[2][n]).abs().max()
        e_torch = (torch16[2][n].double() - ref64[2][n]).abs().max()
        assert e_ours <= 2 * e_torch + 1e-6, (n, float(e_ours), float(e_torch))


def test_initial_weights_in_upstreams_order():
    ref = make_layer()
    w = list(ref.attn_qkvw.detach().chunk(3)) + [
        getattr(ref, n).detach() for n in ("attn_ow", "attn_nw", "inter_w", "output_w", "norm_w")
    ]
    b = list(ref.attn_qkvb.detach().chunk(3)) + [
        getattr(ref, n).detach() for n in ("attn_ob", "attn_nb", "inter_b", "output_b", "norm_b")
    ]
    layer = DeepSpeedTransformerLayer(ref.config, initial_weights=w, initial_biases=b)
    x = torch.randn(B, S, H)
    assert torch.equal(layer(x), ref(x))
    assert layer.config.layer_id == ref.config.layer_id  # the same config object, renumbered


def test_return_tuple_and_layer_ids():
    a = make_layer(return_tuple=True)
    b = make_layer()
    assert b.config.layer_id == a.config.layer_id + 1
    (out,) = a(torch.randn(1, 4, H))
    assert out.shape == (1, 4, H)

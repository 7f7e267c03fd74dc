"""The block-sparse MatMul (sdd, dsd, dds, with transposes), Softmax and SparseSelfAttention
against dense torch math restricted to the same layout: forward and backward, on the C++ op
(CPU tensors) and on the torch-op path other devices take."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_ext.ops.sparse_attention import (
    BigBirdSparsityConfig,
    FixedSparsityConfig,
    MatMul,
    Softmax,
    SparseSelfAttention,
)
from deepspeed_ext.ops.sparse_attention import kernels as K
from deepspeed_ext.ops.sparse_attention.lut import lut_for
from tests.helpers.compile_parity import assert_compiled_matches_eager

BS, NB, H, BATCH, D = 16, 4, 2, 2, 8
SIDE = BS * NB


@pytest.fixture(params=["cpu_op", "torch_path"])
def path(request, monkeypatch):
    if request.param == "torch_path":
        monkeypatch.setattr(K, "path_for", lambda t: K.TorchPath)
        import deepspeed_ext.ops.sparse_attention.matmul as mm
        import deepspeed_ext.ops.sparse_attention.softmax as sm

        monkeypatch.setattr(mm, "path_for", lambda t: K.TorchPath)
        monkeypatch.setattr(sm, "path_for", lambda t: K.TorchPath)
    return request.param


def layout() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lay = (torch.rand(H, NB, NB, generator=g) < 0.4).long()
    lay[:, torch.arange(NB), torch.arange(NB)] = 1  # no empty rows
    return lay


def blocks_of(dense: torch.Tensor, lay: torch.Tensor) -> torch.Tensor:
    """The layout's blocks of dense [b, h, side, side], in (head, row, col) order: a loop."""
    out = [
        dense[:, h, r * BS : (r + 1) * BS, c * BS : (c + 1) * BS]
        for h, r, c in lay.nonzero().tolist()
    ]
    return torch.stack(out, 1)


def dense_of(sparse: torch.Tensor, lay: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    out = torch.full((sparse.shape[0], H, SIDE, SIDE), fill, dtype=sparse.dtype)
    for z, (h, r, c) in enumerate(lay.nonzero().tolist()):
        out[:, h, r * BS : (r + 1) * BS, c * BS : (c + 1) * BS] = sparse[:, z]
    return out


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def grads_match(ours, ref, inputs_ours, inputs_ref, seed=9):
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(ours, inputs_ours, g)
    want = torch.autograd.grad(ref, inputs_ref, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def logical(x, trans):
    return x.transpose(-1, -2) if trans else x


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_sdd(path, ta, tb):
    lay = layout()
    a = rand(BATCH, H, *((D, SIDE) if ta else (SIDE, D)), seed=1)
    b = rand(BATCH, H, *((SIDE, D) if tb else (D, SIDE)), seed=2)
    ours = MatMul(lay, BS, "sdd", ta, tb)(a, b)
    ref = blocks_of(logical(a, ta) @ logical(b, tb), lay)
    grads_match(ours, ref, (a, b), (a, b))


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_dsd(path, ta, tb):
    lay = layout()
    s = rand(BATCH, int(lay.sum()), BS, BS, seed=3)
    b = rand(BATCH, H, *((D, SIDE) if tb else (SIDE, D)), seed=4)
    ours = MatMul(lay, BS, "dsd", ta, tb)(s, b)
    ref = logical(dense_of(s, lay), ta) @ logical(b, tb)
    grads_match(ours, ref, (s, b), (s, b))


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_dds(path, ta, tb):
    lay = layout()
    a = rand(BATCH, H, *((SIDE, D) if ta else (D, SIDE)), seed=5)
    s = rand(BATCH, int(lay.sum()), BS, BS, seed=6)
    ours = MatMul(lay, BS, "dds", ta, tb)(a, s)
    ref = logical(a, ta) @ logical(dense_of(s, lay), tb)
    grads_match(ours, ref, (a, s), (a, s))


@pytest.mark.parametrize("modes", [("add", "add"), ("mul", "mul")])
def test_softmax_with_rpe_and_masks(path, modes):
    lay = layout()
    x = rand(BATCH, int(lay.sum()), BS, BS, seed=7)
    rpe = rand(1, H, SIDE, SIDE, seed=8)
    kp_keep = torch.ones(BATCH, SIDE)
    kp_keep[0, -5:] = 0
    attn_keep = torch.ones(SIDE, SIDE)
    attn_keep[3, :7] = 0
    kp = kp_keep if modes[0] == "mul" else (1 - kp_keep) * -1e4
    attn = attn_keep if modes[1] == "mul" else (1 - attn_keep) * -1e4
    ours = Softmax(lay, BS)(x, 0.3, rpe, kp, attn, *modes)
    z = dense_of(x, lay, float("-inf")) * 0.3 + rpe
    z = (
        z
        + torch.where(kp_keep == 0, float("-inf") if modes[0] == "mul" else -1e4, 0.0)[
            :, None, None
        ]
    )
    z = z + torch.where(attn_keep == 0, float("-inf") if modes[1] == "mul" else -1e4, 0.0)
    ref = blocks_of(torch.softmax(z, -1), lay)
    grads_match(ours, ref, (x, rpe), (x, rpe))


def test_a_row_with_every_key_masked_gives_zeros(path):
    lay = torch.ones(1, 2, 2, dtype=torch.long)
    x = torch.randn(1, 4, BS, BS)
    kp = torch.ones(1, 2 * BS)
    kp[0] = 0  # every key masked: nothing to attend to
    y = Softmax(lay, BS)(x, key_padding_mask=kp, key_padding_mask_mode="mul")
    assert torch.equal(y, torch.zeros_like(y))


def test_a_row_holding_a_nan_is_nan_as_in_torch(path):
    """A diverged score must show: a max that skips NaN once made such rows zeros."""
    lay = torch.ones(1, 2, 2, dtype=torch.long)
    x = torch.randn(1, 4, BS, BS)
    x[0, 0, 3, 5] = float("nan")  # query row 3, one score
    x[0, 1, 7] = float("nan")  # query row 7, every score of one of its blocks
    x[0, 0, 7] = float("nan")  # ... and of the other: the whole row
    y = Softmax(lay, BS)(x)
    assert bool(y[0, :2, 3].isnan().all()) and bool(y[0, :2, 7].isnan().all())
    rest = [r for r in range(BS) if r not in (3, 7)]
    assert not bool(y[0, :2, rest].isnan().any()) and not bool(y[0, 2:].isnan().any())


@pytest.mark.parametrize("value", [-1e9, torch.finfo(torch.float32).min])
def test_huge_finite_masks_act_as_the_floor(path, value):
    """[Note: additive mask floor]: a key masked by a huge finite value weighs 0 as at the
    floor, and a row with every key so masked attends as if the constant were not there."""
    lay = layout()
    x = rand(BATCH, int(lay.sum()), BS, BS, seed=3)
    kp = torch.zeros(BATCH, SIDE)
    kp[0, 5:9] = value  # some keys of batch 0
    kp[1] = value  # every key of batch 1
    y = Softmax(lay, BS)(x, key_padding_mask=kp)
    at_floor = Softmax(lay, BS)(x, key_padding_mask=kp.clamp(min=-1e4))
    grads_match(y, at_floor, (x,), (x,))
    z = dense_of(x.detach(), lay, float("-inf"))
    z[0, :, :, 5:9] = float("-inf")
    want = blocks_of(torch.softmax(z, -1), lay)  # batch 1: a constant shift changes nothing
    torch.testing.assert_close(y[0], want[0])
    torch.testing.assert_close(y[1], want[1], rtol=1e-3, atol=1e-4)


def dense_attention(q, k, v, lay, kp_keep=None):
    mask = lay.repeat_interleave(BS, 1).repeat_interleave(BS, 2).bool()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    if kp_keep is not None:
        s = s.masked_fill(kp_keep[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize(
    "config",
    [
        FixedSparsityConfig(H, BS, num_local_blocks=2, attention="unidirectional"),
        BigBirdSparsityConfig(H, BS, True, num_random_blocks=1),
    ],
    ids=["fixed-uni", "bigbird-per-head"],
)
def test_sparse_self_attention_equals_dense_attention_on_the_layout(path, config):
    att = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=2 * SIDE)
    q, k, v = (rand(BATCH, H, SIDE, D, seed=i) for i in (11, 12, 13))
    kp = torch.ones(BATCH, SIDE)
    kp[1, -9:] = 0
    ours = att(q, k, v, key_padding_mask=kp)
    lay = att.get_layout(SIDE)  # the corner of the max_seq_length layout
    ref = dense_attention(q, k, v, lay, kp)
    grads_match(ours, ref, (q, k, v), (q, k, v))
    # a key given as [b, h, head_dim, seq] is taken too
    torch.testing.assert_close(att(q, k.transpose(-1, -2), v, key_padding_mask=kp), ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_within_twice_torchs_own_error(dtype):
    config = FixedSparsityConfig(H, BS, num_local_blocks=2)
    att = SparseSelfAttention(config, max_seq_length=SIDE)
    q, k, v = (
        torch.randn(BATCH, H, SIDE, D, generator=torch.Generator().manual_seed(i))
        for i in (1, 2, 3)
    )
    lay = att.get_layout(SIDE)
    ref = dense_attention(q.double(), k.double(), v.double(), lay)
    e_ours = (att(q.to(dtype), k.to(dtype), v.to(dtype)).double() - ref).abs().max()
    e_torch = (
        (dense_attention(q.to(dtype), k.to(dtype), v.to(dtype), lay).double() - ref).abs().max()
    )
    assert e_ours <= 2 * e_torch, (float(e_ours), float(e_torch))


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_every_block_size(block):
    lay = torch.tensor([[[1, 0], [1, 1]]])
    a, b = torch.randn(1, 1, 2 * block, 4), torch.randn(1, 1, 4, 2 * block)
    got = MatMul(lay, block, "sdd")(a, b)
    full = a @ b
    want = torch.stack(
        [full[:, 0, :block, :block], full[:, 0, block:, :block], full[:, 0, block:, block:]], 1
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    config = FixedSparsityConfig(H, BS, num_local_blocks=2)
    att = SparseSelfAttention(config, max_seq_length=SIDE)
    q = torch.randn(1, H, SIDE, D)
    with pytest.raises(
        ValueError, match="sequence length 40 is not a multiple of the block size 16"
    ):
        att(q[:, :, :40], q[:, :, :40], q[:, :, :40])
    with pytest.raises(ValueError, match="sequence length 128 exceeds max_seq_length=64"):
        big = torch.randn(1, H, 128, D)
        att(big, big, big)
    with pytest.raises(
        ValueError, match="query has 3 heads but the sparsity config was made for num_heads=2"
    ):
        q3 = torch.randn(1, 3, SIDE, D)
        att(q3, q3, q3)
    with pytest.raises(ValueError, match="layout row 1 of head 0 has no block"):
        MatMul(torch.tensor([[[1, 0], [0, 0]]]), BS, "sdd")
    with pytest.raises(ValueError, match="block=8: the kernels take blocks of 16, 32, 64 or 128"):
        Softmax(torch.ones(1, 2, 2, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="block=8: the kernels take blocks"):  # when built
        SparseSelfAttention(FixedSparsityConfig(H, 8), max_seq_length=SIDE)
    for empty in (q[:, :, :0], q[..., :0]):
        with pytest.raises(ValueError, match="must not be empty"):
            att(empty, empty, empty)
    with pytest.raises(
        ValueError, match=r"rpe has shape \(2, 2, 64, 64\); expected \[1 \(the batch\)"
    ):
        att(q, q, q, rpe=torch.zeros(2, H, SIDE, SIDE))
    with pytest.raises(TypeError, match="SparseSelfAttention: key has dtype torch.float64"):
        att(q, q.double(), q)
    with pytest.raises(ValueError, match="mode='sss'"):
        MatMul(torch.ones(1, 2, 2, dtype=torch.long), BS, "sss")
    lut = lut_for(torch.ones(1, 2, 2, dtype=torch.long), BS)
    bad = lut.packed.clone()
    bad[4] = 5  # a block's head out of range
    with pytest.raises(RuntimeError, match="lut block 0 is out of range"):
        K.op().sdd(torch.randn(1, 1, 32, 4), False, torch.randn(1, 1, 4, 32), False, bad, 4, BS)


def test_the_lut_is_built_once_per_layout():
    lay = torch.ones(1, 3, 3, dtype=torch.long)
    assert lut_for(lay, BS) is lut_for(lay.clone(), BS)


def test_torch_compile_traces_the_ops():
    config = FixedSparsityConfig(H, BS, num_local_blocks=2)
    att = SparseSelfAttention(config, max_seq_length=SIDE)
    q, k, v = (rand(BATCH, H, SIDE, D, seed=i) for i in (21, 22, 23))
    assert_compiled_matches_eager(att, (q, k, v))


def test_mask_and_rpe_shapes():
    """Masks are read by shape, not element count; a strided rpe is as good as a dense one."""
    config = FixedSparsityConfig(H, BS, num_local_blocks=2)
    att = SparseSelfAttention(config, max_seq_length=SIDE)
    q, k, v = (rand(BATCH, H, SIDE, D, seed=i) for i in (31, 32, 33))
    kp = torch.zeros(BATCH, SIDE)
    kp[1, -9:] = -1e4
    want = att(q, k, v, key_padding_mask=kp)
    torch.testing.assert_close(att(q, k, v, key_padding_mask=kp[:, None, None, :]), want)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(64, 2\); expected"):
        att(q, k, v, key_padding_mask=kp.t().contiguous())  # [seq, batch]: same numel
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(1, 128\)"):
        att(q, k, v, key_padding_mask=kp.reshape(1, -1))
    am = (torch.rand(SIDE, SIDE, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    am.fill_diagonal_(1)
    want = att(q, k, v, attn_mask=am)
    torch.testing.assert_close(att(q, k, v, attn_mask=am[None, None]), want)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(2, 1, 64, 64\).*key_padding"):
        att(q, k, v, attn_mask=am.expand(BATCH, 1, SIDE, SIDE))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(64,\)"):
        att(q, k, v, attn_mask=am[0])
    rpe = rand(1, H, SIDE, SIDE, seed=34)
    want = att(q, k, v, rpe=rpe.transpose(-1, -2).contiguous())
    torch.testing.assert_close(att(q, k, v, rpe=rpe.transpose(-1, -2)), want)
    wide = rand(1, H, SIDE, 2 * SIDE, seed=35)
    torch.testing.assert_close(
        att(q, k, v, rpe=wide[..., ::2]), att(q, k, v, rpe=wide[..., ::2].contiguous())
    )


def test_the_layout_travels_in_the_state_dict():
    """master_layout is a buffer, as upstream's: a model's random layout comes back with its
    weights, and a load after use replaces the layout the ops were made from."""
    seq = 2 * SIDE

    def att(seed: int) -> SparseSelfAttention:
        config = BigBirdSparsityConfig(H, BS, num_random_blocks=1, seed=seed)
        return SparseSelfAttention(config, max_seq_length=seq)

    mine, theirs = att(1), att(2)
    assert list(mine.state_dict()) == ["master_layout"]
    assert not torch.equal(mine.master_layout, theirs.master_layout)
    q, k, v = (rand(BATCH, H, seq, D, seed=i) for i in (41, 42, 43))
    before = mine(q, k, v)
    mine.load_state_dict(theirs.state_dict())
    assert torch.equal(mine.master_layout, theirs.master_layout)
    after = mine(q, k, v)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, theirs(q, k, v))
    torch.testing.assert_close(after, dense_attention(q, k, v, theirs.get_layout(seq)))
    # an in-place edit of the layout after use: the ops follow it too
    fresh = att(1)
    mine.master_layout.copy_(fresh.master_layout)
    torch.testing.assert_close(mine(q, k, v), before)

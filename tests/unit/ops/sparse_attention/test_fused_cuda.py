"""Fused block-sparse attention ([Note: fused block-sparse attention]) against dense attention
masked by the same layout in float64: output and every gradient, fp16 and bf16, blocks 16 and
32 (coarse tiles with sub-block masks), 64 and 128 (one and four kernel tiles a block), head
sizes 64 and 128, layouts that differ per head, a causal layout (tiles whose rows attend to
nothing in them), key padding masks in both modes (query rows left with no key give zeros), a
key block no query attends to (zero dK and dV there), the path SparseSelfAttention takes,
torch.compile tracing, and the input checks. 16-bit results stay within twice the error of
torch's own 16-bit dense attention. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.sparse_attention import (
    BigBirdSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    fused,
)
from deepspeed_ext.ops.sparse_attention import kernels as K
from deepspeed_ext.ops.sparse_attention.lut import lut_for, tiles_for
from tests.helpers.compile_parity import assert_compiled_matches_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16]
H, BATCH = 2, 2


def randn(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).cuda()


def dense_attention(q, k, v, lay, block, bias=None):
    """Attention masked by the layout, plus bias[b, key] (-inf drops the key); a query row
    with no key left gives zeros (with zero gradients, not NaN). With a bias the scores and
    softmax are fp32 at least (in 16 bits, scores near a bias of -1e4 would keep no digits)."""
    keep = lay.repeat_interleave(block, 1).repeat_interleave(block, 2).bool().to(q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        bias = bias.to(q.device)[:, None, None, :]
        keep = keep & (bias != float("-inf"))
        s = s.float() + bias.masked_fill(bias == float("-inf"), 0).to(s.dtype).float()
    has = keep.any(-1, keepdim=True)
    p = torch.softmax(torch.where(keep, s, float("-inf")).where(has, 0), -1) * has
    return p.to(v.dtype) @ v


def outputs_and_grads(fn, dtype, q, k, v, g) -> list[torch.Tensor]:
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*xs)
    return [out, *torch.autograd.grad(out, xs, g.to(dtype))]


def check_against_dense(fn, lay, block, dtype, seq, head_dim, bias=None) -> list[torch.Tensor]:
    q, k, v = (randn(BATCH, H, seq, head_dim, seed=i) for i in (1, 2, 3))
    g = randn(BATCH, H, seq, head_dim, seed=4)
    ours = outputs_and_grads(fn, dtype, q, k, v, g)

    def dense(*a):
        return dense_attention(*a, lay, block, bias)

    ref = outputs_and_grads(dense, torch.float64, q, k, v, g)
    own = outputs_and_grads(dense, dtype, q, k, v, g)
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, own):
        e_ours, e_torch = (float((x.detach().double() - r).abs().max()) for x in (o, t))
        assert e_ours <= 2 * e_torch + 1e-3, (name, e_ours, e_torch)
    return ours


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_sparse_self_attention_runs_fused_and_matches_dense(block, dtype, head_dim, no_unfused):
    config = BigBirdSparsityConfig(
        H, block, different_layout_per_head=True, num_random_blocks=1, num_global_blocks=1
    )
    seq = 5 * block if block >= 64 else 320
    att = SparseSelfAttention(config, max_seq_length=seq)
    lay = att.get_layout(seq)
    assert not torch.equal(lay[0], lay[1])
    check_against_dense(att, lay, block, dtype, seq, head_dim)


@pytest.fixture
def no_unfused(monkeypatch):
    def unfused(*a, **kw):
        raise AssertionError("the unfused block-sparse ops ran")

    monkeypatch.setattr(K.CUDAPath, "sdd", unfused)


@pytest.mark.parametrize("block,seq", [(16, 208), (32, 96)])
def test_a_length_off_the_tile_grid_runs_fused_and_matches_dense(block, seq, no_unfused):
    """The operands are padded to whole tiles whose padded sub-blocks have no bit set."""
    config = BigBirdSparsityConfig(H, block, different_layout_per_head=True, num_random_blocks=1)
    att = SparseSelfAttention(config, max_seq_length=seq)
    check_against_dense(att, att.get_layout(seq), block, torch.bfloat16, seq, 64)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_causal_fine_layout_skips_what_its_tiles_do_not_attend(head_dim, no_unfused):
    config = FixedSparsityConfig(H, 16, num_local_blocks=3, attention="unidirectional")
    att = SparseSelfAttention(config, max_seq_length=256)
    lay = att.get_layout(256)
    masks = tiles_for(lay, 16).mask
    assert masks is not None and (masks != 0xFFFF).any()
    check_against_dense(att, lay, 16, torch.bfloat16, 256, head_dim)


@pytest.mark.parametrize("mode", ["add", "mul", "add_huge"])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_a_key_padding_mask_runs_fused_and_matches_dense(block, mode, no_unfused):
    """'add' adds the mask (random finite values here); 'mul' drops keys where it is 0. Head
    0's last block row attends only to the last block's keys, which batch 1 masks: with 'mul'
    those rows give zeros; with huge finite values ([Note: additive mask floor]) they attend
    as if unmasked. With 'mul', batch 1 also drops the first block's keys, so rows of head 0
    meet a tile they see nothing of before one they do."""
    nb, seq = 4 * (64 // block if block < 64 else 1), 256 if block < 64 else 4 * block
    lay = torch.zeros(H, nb, nb, dtype=torch.long)
    lay[:, torch.arange(nb), torch.arange(nb)] = 1
    lay[0, :, 0] = 1
    lay[0, nb - 1, 0] = 0  # the last block row: its diagonal block only
    lay[1] = torch.tril(torch.ones(nb, nb, dtype=torch.long))
    g = torch.Generator().manual_seed(7)
    if mode == "add":
        kp = torch.randn(BATCH, seq, generator=g) * 3
        bias = kp
    elif mode == "mul":
        kp = torch.ones(BATCH, seq)
        kp[1, seq - seq // nb :] = 0  # batch 1 drops the last block's keys
        kp[1, : seq // nb] = 0  # and the first's
        kp[0, torch.randperm(seq, generator=g)[: seq // 3]] = 0
        bias = torch.zeros(BATCH, seq).masked_fill(kp == 0, float("-inf"))
    else:
        kp = torch.zeros(BATCH, seq)
        kp[1, seq - seq // nb :] = -1e9
        kp[0, torch.randperm(seq, generator=g)[: seq // 3]] = torch.finfo(torch.float32).min
        bias = kp.clamp(min=-1e4)
    config = FixedSparsityConfig(H, block)
    kp_mode = "mul" if mode == "mul" else "add"
    att = SparseSelfAttention(config, key_padding_mask_mode=kp_mode, max_seq_length=seq)
    att.master_layout = lay  # the layout above, through the module's own path

    def fn(q, k, v):
        return att(q, k, v, key_padding_mask=kp.cuda())

    out, *_ = check_against_dense(fn, lay, block, torch.bfloat16, seq, 64, bias)
    rows = slice(seq - seq // nb, seq)
    if mode == "mul":
        assert out[1, 0, rows].abs().max() == 0 and out[0, 0, rows].abs().max() > 0
    else:
        assert out[1, 0, rows].abs().max() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_key_padding_mask_at_head_dim_128(dtype, no_unfused):
    """The dK/dV kernel keeps V in shared memory at head_dim 128: the bias path there."""
    config = BigBirdSparsityConfig(H, 32, num_random_blocks=1, num_global_blocks=1)
    att = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=256)
    kp = torch.ones(BATCH, 256)
    kp[1, 200:] = 0
    bias = torch.zeros(BATCH, 256).masked_fill(kp == 0, float("-inf"))

    def fn(q, k, v):
        return att(q, k, v, key_padding_mask=kp.cuda())

    check_against_dense(fn, att.get_layout(256), 32, dtype, 256, 128, bias)


@pytest.mark.parametrize("block", [64, 128])
def test_a_key_block_no_query_attends_to_gets_zero_gradients(block):
    lay = torch.zeros(H, 4, 4, dtype=torch.long)
    lay[0, [0, 1, 2, 3], [0, 1, 0, 3]] = 1  # head 0: nobody attends to key block 2
    lay[1] = torch.tril(torch.ones(4, 4, dtype=torch.long))
    tiles, scale = tiles_for(lay, block), 64**-0.5
    _, _, dk, dv = check_against_dense(
        lambda q, k, v: fused.attention(q, k, v, tiles, scale),
        lay,
        block,
        torch.bfloat16,
        4 * block,
        64,
    )
    cols = slice(2 * block, 3 * block)
    assert dk[:, 0, cols].abs().max() == 0 and dv[:, 0, cols].abs().max() == 0
    assert dk[:, 1, cols].abs().max() > 0


def test_what_the_fused_kernels_take():
    q = randn(BATCH, H, 256, 64, seed=5).bfloat16()
    assert fused.applies(q, 64) and fused.applies(q, 16) and fused.applies(q, 32)
    assert not fused.applies(q.float(), 64)  # fp32 runs unfused
    assert fused.applies(q[:, :, :96], 32)  # a partial last tile: padded
    assert not fused.applies(q[..., :32], 64)  # head_dim 32


def test_torch_compile_traces_the_fused_path():
    config = BigBirdSparsityConfig(H, 64, num_random_blocks=1)
    att = SparseSelfAttention(config, max_seq_length=256)
    q, k, v = (randn(BATCH, H, 256, 64, seed=i).bfloat16().requires_grad_() for i in (21, 22, 23))
    assert_compiled_matches_eager(att, (q, k, v))


def test_bad_input_is_named():
    lay = torch.ones(1, 2, 2, dtype=torch.long)
    lut, op, dev = lut_for(lay, 64), K.cuda_op(), torch.device("cuda", 0)
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        op.flash_fwd(q.float(), q.float(), q.float(), lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        op.flash_fwd(q[..., :48].contiguous(), q, q, lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match=r"k has shape .*\(not contiguous\)"):
        op.flash_fwd(q, q.transpose(-1, -2).contiguous().transpose(-1, -2), q, lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match="v is .* but q is"):
        op.flash_fwd(q, q, q.half(), lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match="fits no layout"):
        op.flash_fwd(q, q, q, lut.on(dev)[:-1], 64, 1.0)
    with pytest.raises(RuntimeError, match="lut must be a contiguous 1-D int32 tensor on cuda"):
        op.flash_fwd(q, q, q, lut.packed, 64, 1.0)
    odd = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view_as(q).copy_(q)
    with pytest.raises(RuntimeError, match="not a multiple of 16 bytes"):
        op.flash_fwd(odd, q, q, lut.on(dev), 64, 1.0)
    tiles = tiles_for(lay, 64)
    torch.testing.assert_close(  # fused.attention copies such a view
        fused.attention(odd, q, q, tiles, 1.0), fused.attention(q, q, q, tiles, 1.0)
    )
    with pytest.raises(RuntimeError, match="a tile_mask goes with a table of block 64"):
        one = lut_for(torch.ones(1, 1, 1, dtype=torch.long), 128).on(dev)
        op.flash_fwd(q, q, q, one, 128, 1.0, torch.ones(1, device="cuda"))
    mask = torch.full((4,), 0xFFFF, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="tile_mask must be a contiguous 1-D int32 tensor of"):
        op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0, mask[:3])
    with pytest.raises(RuntimeError, match=r"key_bias must be a contiguous float32 \[1, 128\]"):
        op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0, None, torch.zeros(1, 64, device="cuda"))
    odd_bias = torch.zeros(129, device="cuda")[1:].view(1, 128)
    with pytest.raises(RuntimeError, match="key_bias starts at an address that is not a multiple"):
        op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0, None, odd_bias)
    full = op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0, mask, torch.zeros(1, 128, device="cuda"))
    torch.testing.assert_close(full[0], op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0)[0])
    o, lse = op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match="lse must be the forward's contiguous float32"):
        op.flash_bwd(q, q, q, o, lse.half(), o, lut.on(dev), 64, 1.0)

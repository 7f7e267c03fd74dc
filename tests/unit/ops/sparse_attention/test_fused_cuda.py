"""Fused block-sparse attention ([Note: fused block-sparse attention]) against dense attention
masked by the same layout in float64: output and every gradient, fp16 and bf16, blocks 64 and
128 (one and four kernel tiles a block), head sizes 64 and 128, layouts that differ per head,
a key block no query attends to (zero dK and dV there), the path SparseSelfAttention takes,
torch.compile tracing, and the input checks. 16-bit results stay within twice the error of
torch's own 16-bit dense attention. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention, fused
from deepspeed_ext.ops.sparse_attention import kernels as K
from deepspeed_ext.ops.sparse_attention.lut import lut_for
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


def dense_attention(q, k, v, lay, block):
    mask = lay.repeat_interleave(block, 1).repeat_interleave(block, 2).bool().to(q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return p @ v


def outputs_and_grads(fn, dtype, q, k, v, g) -> list[torch.Tensor]:
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*xs)
    return [out, *torch.autograd.grad(out, xs, g.to(dtype))]


def check_against_dense(fn, lay, block, dtype, seq, head_dim) -> list[torch.Tensor]:
    q, k, v = (randn(BATCH, H, seq, head_dim, seed=i) for i in (1, 2, 3))
    g = randn(BATCH, H, seq, head_dim, seed=4)
    ours = outputs_and_grads(fn, dtype, q, k, v, g)
    ref = outputs_and_grads(lambda *a: dense_attention(*a, lay, block), torch.float64, q, k, v, g)
    own = outputs_and_grads(lambda *a: dense_attention(*a, lay, block), dtype, q, k, v, g)
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, own):
        e_ours, e_torch = (float((x.detach().double() - r).abs().max()) for x in (o, t))
        assert e_ours <= 2 * e_torch + 1e-3, (name, e_ours, e_torch)
    return ours


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [64, 128])
def test_sparse_self_attention_runs_fused_and_matches_dense(block, dtype, head_dim, monkeypatch):
    config = BigBirdSparsityConfig(
        H, block, different_layout_per_head=True, num_random_blocks=1, num_global_blocks=1
    )
    seq = 5 * block
    att = SparseSelfAttention(config, max_seq_length=seq)
    lay = att.get_layout(seq)
    assert not torch.equal(lay[0], lay[1])

    def unfused(*a, **kw):
        raise AssertionError("the unfused block-sparse ops ran")

    monkeypatch.setattr(K.CUDAPath, "sdd", unfused)
    check_against_dense(att, lay, block, dtype, seq, head_dim)


@pytest.mark.parametrize("block", [64, 128])
def test_a_key_block_no_query_attends_to_gets_zero_gradients(block):
    lay = torch.zeros(H, 4, 4, dtype=torch.long)
    lay[0, [0, 1, 2, 3], [0, 1, 0, 3]] = 1  # head 0: nobody attends to key block 2
    lay[1] = torch.tril(torch.ones(4, 4, dtype=torch.long))
    lut, scale = lut_for(lay, block), 64**-0.5
    _, _, dk, dv = check_against_dense(
        lambda q, k, v: fused.attention(q, k, v, lut, scale),
        lay,
        block,
        torch.bfloat16,
        4 * block,
        64,
    )
    cols = slice(2 * block, 3 * block)
    assert dk[:, 0, cols].abs().max() == 0 and dv[:, 0, cols].abs().max() == 0
    assert dk[:, 1, cols].abs().max() > 0


def test_masks_and_fp32_run_unfused():
    config = BigBirdSparsityConfig(H, 64, num_random_blocks=1)
    att = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=256)
    q = randn(BATCH, H, 256, 64, seed=5)
    assert fused.applies(q.bfloat16(), 64)
    assert not fused.applies(q, 64)  # fp32
    assert not fused.applies(q.bfloat16(), 32)
    assert not fused.applies(q[..., :32].bfloat16(), 64)
    kp = torch.ones(BATCH, 256, device="cuda")
    kp[1, -70:] = 0
    lay = att.get_layout(256)
    x = q.bfloat16()
    out = att(x, x, x, key_padding_mask=kp).double()
    mask = lay.repeat_interleave(64, 1).repeat_interleave(64, 2).bool().cuda()
    s = (q.double() @ q.double().transpose(-1, -2) / 8).masked_fill(~mask, float("-inf"))
    s = s.masked_fill(kp[:, None, None, :] == 0, float("-inf"))
    ref = torch.softmax(s, -1) @ q.double()
    assert float((out - ref).abs().max()) < 0.05  # the key padding mask was honoured


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
    torch.testing.assert_close(  # fused.attention copies such a view
        fused.attention(odd, q, q, lut, 1.0), fused.attention(q, q, q, lut, 1.0)
    )
    o, lse = op.flash_fwd(q, q, q, lut.on(dev), 64, 1.0)
    with pytest.raises(RuntimeError, match="lse must be the forward's contiguous float32"):
        op.flash_bwd(q, q, q, o, lse.half(), o, lut.on(dev), 64, 1.0)

"""The sparse attention CUDA op ([Note: block-sparse CUDA kernels]) against the same math in
float64 torch ops on the GPU (the torch path): sdd, dsd and dds with every transpose, the
softmax with its additive terms, SparseSelfAttention forward and backward against dense masked
attention, every block size and dtype, odd head sizes (partial K, row and column tiles), and
its input checks. 16-bit results stay within twice the error of torch's own 16-bit math.
Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.sparse_attention import (
    BigBirdSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
)
from deepspeed_ext.ops.sparse_attention import kernels as K
from deepspeed_ext.ops.sparse_attention.lut import lut_for
from tests.helpers.compile_parity import assert_compiled_matches_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
H, BATCH = 2, 2


def layout(nb: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lay = (torch.rand(H, nb, nb, generator=g) < 0.4).long()
    lay[:, torch.arange(nb), torch.arange(nb)] = 1  # no empty rows
    lay[0, 0, :] = 1  # a full row and an empty-ish column elsewhere
    return lay


def randn(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).cuda()


def check(ours: torch.Tensor, args64: tuple, fn, dtype: torch.dtype) -> None:
    """ours against fn in float64; 16-bit: within twice torch's own error in that dtype."""
    ref = fn(*args64)
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)
        return
    own = fn(*(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args64))
    e_ours = float((ours.double() - ref).abs().max())
    e_torch = float((own.double() - ref).abs().max())
    assert e_ours <= 2 * e_torch + 1e-3, (e_ours, e_torch)


def logical_shape(rows: int, cols: int, trans: bool) -> tuple[int, int]:
    return (cols, rows) if trans else (rows, cols)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mode", ["sdd", "dsd", "dds"])
def test_matmul_modes(mode, ta, tb, block, dtype):
    nb, d = 3, 72  # 72: a K step, a row tile and a column tile each end part-way
    lay = layout(nb)
    lut = lut_for(lay, block)
    side = nb * block
    sparse = lambda seed: randn(BATCH, lut.nnz, block, block, seed=seed)  # noqa: E731

    def dense(rows, cols, trans, seed):
        return randn(BATCH, H, *logical_shape(rows, cols, trans), seed=seed)

    if mode == "sdd":
        a, b = dense(side, d, ta, 1), dense(d, side, tb, 2)
    elif mode == "dsd":
        a, b = sparse(1), dense(side, d, tb, 2)
    else:
        a, b = dense(d, side, ta, 1), sparse(2)
    a64, b64 = a.double(), b.double()
    ours = getattr(K.CUDAPath, mode)(a.to(dtype), ta, b.to(dtype), tb, lut)
    assert ours.dtype == dtype
    check(ours, (a64, ta, b64, tb, lut), getattr(K.TorchPath, mode), dtype)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_block_size(block, dtype):
    lay = layout(2, seed=block)
    lut = lut_for(lay, block)
    q, k = randn(1, H, 2 * block, 40, seed=3), randn(1, H, 2 * block, 40, seed=4)
    ours = K.CUDAPath.sdd(q.to(dtype), False, k.to(dtype), True, lut)
    check(ours, (q.double(), False, k.double(), True, lut), K.TorchPath.sdd, dtype)
    v = randn(1, H, 2 * block, 40, seed=5)
    probs = ours.float().softmax(-1).to(dtype)
    out = K.CUDAPath.dsd(probs, False, v.to(dtype), False, lut)
    check(out, (probs.double(), False, v.double(), False, lut), K.TorchPath.dsd, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_with_rpe_and_masks(dtype):
    block, nb = 16, 4
    lay = layout(nb, seed=1)
    lut = lut_for(lay, block)
    side = nb * block
    x = randn(BATCH, lut.nnz, block, block, seed=1)
    rpe = randn(BATCH, H, side, side, seed=2)
    kp = torch.zeros(BATCH, side, device="cuda")
    kp[1, -7:] = float("-inf")
    attn = randn(side, side, seed=3)
    attn[5, :] = float("-inf")  # a row with every key masked gives zeros
    ours = K.CUDAPath.softmax_fwd(x.to(dtype), 0.3, rpe, kp, attn, lut)
    check(ours, (x.double(), 0.3, rpe, kp, attn, lut), K.TorchPath.softmax_fwd, dtype)
    rows5 = K.to_dense(ours.float(), lut)[:, :, 5]
    assert torch.equal(rows5, torch.zeros_like(rows5))
    dy = randn(*ours.shape, seed=4)
    y64 = K.TorchPath.softmax_fwd(x.double(), 0.3, rpe, kp, attn, lut)
    dx = K.CUDAPath.softmax_bwd(ours, dy.to(dtype), 0.3, lut)
    check(dx, (y64, dy.double(), 0.3, lut), K.TorchPath.softmax_bwd, dtype)


def dense_attention(q, k, v, lay, block, kp_keep=None):
    mask = lay.repeat_interleave(block, 1).repeat_interleave(block, 2).bool().to(q.device)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    if kp_keep is not None:
        s = s.masked_fill(kp_keep[:, None, None, :] == 0, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [16, 64])
def test_sparse_self_attention_forward_and_backward(block, dtype):
    config = BigBirdSparsityConfig(H, block, True, num_random_blocks=1)
    seq = 4 * block
    att = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=seq)
    lay = att.get_layout(seq)
    q, k, v = (randn(BATCH, H, seq, 64, seed=i) for i in (11, 12, 13))
    kp = torch.ones(BATCH, seq, device="cuda")
    kp[1, -9:] = 0
    g = randn(BATCH, H, seq, 64, seed=14)

    def run(dt, fn):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        return [out, *torch.autograd.grad(out, xs, g.to(dt))]

    ours = run(dtype, lambda a, b, c: att(a, b, c, key_padding_mask=kp))
    ref = run(torch.float64, lambda a, b, c: dense_attention(a, b, c, lay, block, kp))
    own = run(dtype, lambda a, b, c: dense_attention(a, b, c, lay, block, kp))
    for o, r, t in zip(ours, ref, own):
        if dtype == torch.float32:
            torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4)
        else:
            e_ours, e_torch = (float((x.detach().double() - r).abs().max()) for x in (o, t))
            assert e_ours <= 2 * e_torch + 1e-3, (e_ours, e_torch)


def test_the_cuda_op_runs_for_cuda_tensors():
    lut = lut_for(layout(2), 16)
    assert K.path_for(torch.zeros(1, device="cuda")) is K.CUDAPath
    assert lut.on(torch.device("cuda", 0)) is lut.on(torch.device("cuda", 0))  # copied once


def test_bad_input_is_named():
    lut = lut_for(torch.ones(1, 2, 2, dtype=torch.long), 16)
    op, dev = K.cuda_op(), torch.device("cuda", 0)
    a, b = torch.randn(1, 1, 32, 4, device="cuda"), torch.randn(1, 1, 4, 32, device="cuda")
    with pytest.raises(RuntimeError, match="a must be a CUDA tensor"):
        op.sdd(a.cpu(), False, b.cpu(), False, lut.packed, 4, 16)
    with pytest.raises(RuntimeError, match="lut has 10 entries"):
        op.sdd(a, False, b, False, lut.on(dev)[:10], 4, 16)
    with pytest.raises(RuntimeError, match="lut must be a contiguous 1-D int32 tensor on cuda"):
        op.sdd(a, False, b, False, lut.packed, 4, 16)
    with pytest.raises(RuntimeError, match="b has dtype"):
        op.sdd(a, False, b.half(), False, lut.on(dev), 4, 16)
    with pytest.raises(RuntimeError, match=r"the layout needs \[32, K\] @ \[K, 32\]"):
        op.sdd(a, False, b[..., :16], False, lut.on(dev), 4, 16)
    with pytest.raises(RuntimeError, match="expected a contiguous"):
        x = torch.randn(1, 4, 16, 16, device="cuda")
        op.softmax_fwd(x.transpose(-1, -2), 1.0, None, None, None, lut.on(dev), 1)
    with pytest.raises(RuntimeError, match="rpe must be a float32 tensor"):
        x = torch.randn(1, 4, 16, 16, device="cuda")
        rpe = torch.randn(1, 1, 32, 32, device="cuda").half()
        op.softmax_fwd(x, 1.0, rpe, None, None, lut.on(dev), 1)


def test_torch_compile_traces_the_cuda_ops():
    config = FixedSparsityConfig(H, 16, num_local_blocks=2)
    att = SparseSelfAttention(config, max_seq_length=64)
    q, k, v = (randn(BATCH, H, 64, 32, seed=i).requires_grad_() for i in (21, 22, 23))
    assert_compiled_matches_eager(att, (q, k, v))

"""How SparseSelfAttention reaches the fused CUDA kernels, checked on CPU with a stand-in op of
the same schemas (the kernels themselves are tested in test_fused_cuda.py, on a GPU): which
calls take the fused path (key padding masks and blocks of 16 and 32 too, with the bias and
the tile mask reaching both kernels), that flash_fwd's autograd runs flash_bwd and routes its
three gradients (also when one tensor is q, k and v), and that torch.compile traces the path
whole."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention, fused
from deepspeed_ext.ops.sparse_attention import kernels as K
from tests.helpers.compile_parity import assert_compiled_matches_eager

_LIBS: list[torch.library.Library] = []  # kept alive: a dropped Library unregisters its ops


def flash_library(name: str, fwd, bwd) -> None:
    """A library `name` with the CUDA op's flash_fwd/flash_bwd schemas, implemented on CPU by
    fwd and bwd, with the fused path's autograd."""
    lib = torch.library.Library(name, "DEF")
    lib.define(
        "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor lut, int block, float scale, "
        "Tensor? tile_mask=None, Tensor? key_bias=None) -> (Tensor, Tensor)"
    )
    lib.define(
        "flash_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, Tensor lut, "
        "int block, float scale, Tensor? tile_mask=None, Tensor? key_bias=None) -> "
        "(Tensor, Tensor, Tensor)"
    )
    lib.impl("flash_fwd", fwd, "CPU")
    lib.impl("flash_bwd", bwd, "CPU")
    K.register_flash_autograd(name)
    _LIBS.append(lib)


LIB = "ds_test_stand_in_flash"
CALLS: list[str] = []
ARGS: dict = {}  # flash_fwd's last block, tile mask and key bias


def _extras(tile_mask, key_bias) -> str:
    return ("+mask" if tile_mask is not None else "") + ("+bias" if key_bias is not None else "")


def _fwd(q, k, v, lut, block, scale, tile_mask=None, key_bias=None):
    ARGS.update(block=block, tile_mask=tile_mask, key_bias=key_bias)
    CALLS.append("fwd" + _extras(tile_mask, key_bias))
    o = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v  # dense: the layout is not used
    return o, q.new_zeros(q.shape[:3], dtype=torch.float32)


def _bwd(q, k, v, o, lse, dout, lut, block, scale, tile_mask=None, key_bias=None):
    CALLS.append("bwd" + _extras(tile_mask, key_bias))
    return dout * 2, dout * 3, dout * 4  # tells the three gradients apart


flash_library(LIB, _fwd, _bwd)


@torch.library.register_fake(f"{LIB}::flash_fwd")
def _fwd_fake(q, k, v, lut, block, scale, tile_mask=None, key_bias=None):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake(f"{LIB}::flash_bwd")
def _bwd_fake(q, k, v, o, lse, dout, lut, block, scale, tile_mask=None, key_bias=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(K, "cuda_op", lambda: getattr(torch.ops, LIB))
    monkeypatch.setattr(fused, "applies", lambda q, block: True)
    CALLS.clear()
    return CALLS


def attention() -> SparseSelfAttention:
    return SparseSelfAttention(
        BigBirdSparsityConfig(2, 64, num_random_blocks=1), max_seq_length=256
    )


def test_cpu_tensors_do_not_apply():
    assert not fused.applies(torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16), 64)


def test_plain_calls_run_fused_and_gradients_come_from_flash_bwd(stand_in):
    att = attention()
    q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
    out = att(q, k, v)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert stand_in == ["fwd", "bwd"]
    torch.testing.assert_close((dq, dk, dv), (2 * g, 3 * g, 4 * g))
    (dx,) = torch.autograd.grad(att(q, q, q), (q,), g)  # one tensor as all three
    torch.testing.assert_close(dx, 9 * g)


def test_rpe_attn_mask_and_fused_false_run_unfused(stand_in):
    att = attention()
    q = torch.randn(1, 2, 256, 64)
    att(q, q, q, attn_mask=torch.ones(256, 256))
    att(q, q, q, rpe=torch.zeros(1, 2, 256, 256))
    att.fused = False
    att(q, q, q)
    att(q, q, q, key_padding_mask=torch.ones(1, 256))
    assert stand_in == []


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_a_key_padding_mask_reaches_both_kernels_as_an_additive_bias(stand_in, mode):
    att = SparseSelfAttention(
        BigBirdSparsityConfig(2, 64, num_random_blocks=1),
        key_padding_mask_mode=mode,
        max_seq_length=256,
    )
    q = torch.randn(2, 2, 256, 64, requires_grad=True)
    kp = torch.ones(2, 1, 1, 256) if mode == "mul" else torch.zeros(2, 1, 1, 256)
    kp[1, ..., 200:] = 0 if mode == "mul" else -5.0
    att(q, q, q, key_padding_mask=kp).sum().backward()
    assert stand_in == ["fwd+bias", "bwd+bias"]
    bias = ARGS["key_bias"]
    assert bias.shape == (2, 256) and bias.dtype == torch.float32
    assert (bias[0] == 0).all() and (bias[1, :200] == 0).all()
    assert (bias[1, 200:] == (float("-inf") if mode == "mul" else -5.0)).all()
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 255\)"):
        att(q, q, q, key_padding_mask=torch.zeros(2, 255))


@pytest.mark.parametrize("block", [16, 32])
def test_fine_blocks_run_fused_on_coarse_tiles_with_their_masks(stand_in, block):
    att = SparseSelfAttention(
        BigBirdSparsityConfig(2, block, num_random_blocks=1), max_seq_length=256
    )
    q = torch.randn(1, 2, 256, 64, requires_grad=True)
    att(q, q, q).sum().backward()
    assert stand_in == ["fwd+mask", "bwd+mask"]
    tiles = att.get_tiles(256)
    assert ARGS["block"] == 64 and torch.equal(ARGS["tile_mask"], tiles.mask)


@pytest.mark.parametrize("same", [False, True], ids=["qkv", "one_tensor"])
def test_torch_compile_traces_the_fused_path_whole(stand_in, same):
    att = attention()
    q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
    args = (q, q, q) if same else (q, k, v)
    assert_compiled_matches_eager(att, args)


@pytest.mark.parametrize("block,seq", [(16, 80), (32, 96)])
def test_a_partial_last_tile_is_padded_for_the_kernels_and_cut_off_after(stand_in, block, seq):
    att = SparseSelfAttention(
        BigBirdSparsityConfig(2, block, num_random_blocks=1), max_seq_length=seq
    )
    q = torch.randn(2, 2, seq, 64, requires_grad=True)
    kp = torch.ones(2, seq)
    out = att(q, q, q, key_padding_mask=kp)
    assert out.shape == q.shape and ARGS["key_bias"].shape == (2, 128)
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert dq.shape == q.shape and stand_in == ["fwd+mask+bias", "bwd+mask+bias"]


def test_torch_compile_traces_fine_blocks_with_a_key_padding_mask(stand_in):
    att = SparseSelfAttention(BigBirdSparsityConfig(2, 16, num_random_blocks=1), max_seq_length=256)
    q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
    kp = torch.zeros(1, 256)
    assert_compiled_matches_eager(lambda *a: att(*a, key_padding_mask=kp), (q, k, v))


# An emulation of the fused kernels' contract in dense torch math, read from what the op is
# given (the packed table, the tile mask, the key bias): CPU checks that tiles_for, the
# padding of a partial last tile and the key bias mean what the unfused ops compute.
EMU = "ds_test_emulated_flash"


def _allowed(lut, block, tile_mask, seq):
    nnz, heads = int(lut[0]), int(lut[1])
    blocks = lut[4 : 4 + 3 * nnz].view(nnz, 3).tolist()
    keep = torch.zeros(heads, seq, seq, dtype=torch.bool)
    for z, (h, r, c) in enumerate(blocks):
        if tile_mask is None:
            keep[h, r * block : (r + 1) * block, c * block : (c + 1) * block] = True
            continue
        for bit in range(16):
            if int(tile_mask[z]) >> bit & 1:
                i, j = r * block + 16 * (bit // 4), c * block + 16 * (bit % 4)
                keep[h, i : i + 16, j : j + 16] = True
    return keep


def _emulated(q, k, v, lut, block, scale, tile_mask, key_bias):
    keep = _allowed(lut, block, tile_mask, q.shape[-2])[None].expand(q.shape[0], -1, -1, -1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if key_bias is not None:
        keep = keep & (key_bias != float("-inf"))[:, None, None, :]
        s = s + key_bias.masked_fill(key_bias == float("-inf"), 0)[:, None, None, :]
    has = keep.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")).where(has, 0), -1) * has
    return (p @ v.float()).to(q.dtype)


def _emu_fwd(q, k, v, lut, block, scale, tile_mask=None, key_bias=None):
    return _emulated(q, k, v, lut, block, scale, tile_mask, key_bias), q.new_zeros(q.shape[:3])


def _emu_bwd(q, k, v, o, lse, dout, lut, block, scale, tile_mask=None, key_bias=None):
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _emulated(*xs, lut, block, scale, tile_mask, key_bias)
        return torch.autograd.grad(out, xs, dout)


flash_library(EMU, _emu_fwd, _emu_bwd)


@pytest.mark.parametrize("block,seq", [(16, 80), (16, 256), (32, 96)])
@pytest.mark.parametrize("mode", ["add", "mul"])
def test_the_fused_contract_equals_the_unfused_ops(monkeypatch, block, seq, mode):
    """What SparseSelfAttention hands the fused op (tiles, padding, key bias), executed by
    the emulation, against the unfused CPU ops: output and gradients."""
    config = BigBirdSparsityConfig(2, block, different_layout_per_head=True, num_random_blocks=1)
    att = SparseSelfAttention(config, key_padding_mask_mode=mode, max_seq_length=seq)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, seq, 64, generator=g, requires_grad=True) for _ in range(3))
    kp = torch.ones(2, seq) if mode == "mul" else torch.randn(2, seq, generator=g)
    kp[1, seq - 24 :] = 0 if mode == "mul" else -1e9
    dout = torch.randn(2, 2, seq, 64, generator=g)
    att.fused = False
    ref = att(q, k, v, key_padding_mask=kp)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    att.fused = True
    monkeypatch.setattr(K, "cuda_op", lambda: getattr(torch.ops, EMU))
    monkeypatch.setattr(fused, "applies", lambda q, block: True)
    out = att(q, k, v, key_padding_mask=kp)
    got = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

"""How SparseSelfAttention reaches the fused CUDA kernels, checked on CPU with a stand-in op of
the same schemas (the kernels themselves are tested in test_fused_cuda.py, on a GPU): which
calls take the fused path, that flash_fwd's autograd runs flash_bwd and routes its three
gradients (also when one tensor is q, k and v), and that torch.compile traces the path whole."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention, fused
from deepspeed_ext.ops.sparse_attention import kernels as K
from tests.helpers.compile_parity import assert_compiled_matches_eager

LIB = "ds_test_stand_in_flash"
_lib = torch.library.Library(LIB, "DEF")
_lib.define(
    "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor lut, int block, float scale) -> "
    "(Tensor, Tensor)"
)
_lib.define(
    "flash_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, Tensor lut, "
    "int block, float scale) -> (Tensor, Tensor, Tensor)"
)
CALLS: list[str] = []


def _fwd(q, k, v, lut, block, scale):
    CALLS.append("fwd")
    o = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v  # dense: the layout is not used
    return o, q.new_zeros(q.shape[:3], dtype=torch.float32)


def _bwd(q, k, v, o, lse, dout, lut, block, scale):
    CALLS.append("bwd")
    return dout * 2, dout * 3, dout * 4  # tells the three gradients apart


_lib.impl("flash_fwd", _fwd, "CPU")
_lib.impl("flash_bwd", _bwd, "CPU")


@torch.library.register_fake(f"{LIB}::flash_fwd")
def _fwd_fake(q, k, v, lut, block, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake(f"{LIB}::flash_bwd")
def _bwd_fake(q, k, v, o, lse, dout, lut, block, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


K.register_flash_autograd(LIB)


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


def test_masks_and_fused_false_run_unfused(stand_in):
    att = attention()
    q = torch.randn(1, 2, 256, 64)
    att(q, q, q, key_padding_mask=torch.zeros(1, 256))
    att.fused = False
    att(q, q, q)
    assert stand_in == []


@pytest.mark.parametrize("same", [False, True], ids=["qkv", "one_tensor"])
def test_torch_compile_traces_the_fused_path_whole(stand_in, same):
    att = attention()
    q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
    args = (q, q, q) if same else (q, k, v)
    assert_compiled_matches_eager(att, args)

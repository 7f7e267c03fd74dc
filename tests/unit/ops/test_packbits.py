"""Sign packing against a Python reference of [Note: sign packing]: the same bytes, scale and
error buffer, every dtype, every length class (empty, under a byte, the SIMD tails, several
parallel pieces); CUDA equal to the CPU kernel where a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.packbits import op, sign_compress, sign_decompress

SIZES = [0, 1, 7, 8, 9, 31, 33, 1003, 8 * 65536 + 13]


def reference(x: torch.Tensor, error: torch.Tensor | None) -> tuple[bytes, float, torch.Tensor]:
    y = x.float().reshape(-1) + (error if error is not None else 0)
    scale = float(torch.sqrt(y.double().square().sum() / max(y.numel(), 1)))
    bits = np.packbits((y >= 0).numpy(), bitorder="little").tobytes()
    sign = torch.where(y >= 0, 1.0, -1.0)
    return bits, scale, y - torch.tensor(scale, dtype=torch.float32) * sign


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_the_reference(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(dtype)
    x[: n // 10] = 0  # zeros count as positive
    error = torch.randn(n, generator=gen) * 0.1
    want_bits, want_scale, want_error = reference(x, error)
    bits, scale = sign_compress(x, error)
    assert bits.numpy().tobytes() == want_bits
    assert float(scale) == pytest.approx(want_scale, rel=1e-6)
    torch.testing.assert_close(error, want_error, rtol=1e-6, atol=1e-6)
    plain_bits, _ = sign_compress(x)  # no error feedback: the signs of x itself
    assert plain_bits.numpy().tobytes() == reference(x, None)[0]


@pytest.mark.parametrize("n", SIZES)
def test_unpack_is_plus_or_minus_scale_and_accumulates(n: int) -> None:
    x = torch.randn(n)
    bits, scale = sign_compress(x)
    out = sign_decompress(bits, scale, n)
    want = torch.where(x >= 0, 1.0, -1.0) * scale
    assert torch.equal(out, want)
    base = torch.randn(n)
    acc = sign_decompress(bits, scale, n, out=base.clone(), accumulate=True)
    torch.testing.assert_close(acc, base + want)


def test_error_feedback_keeps_the_sum_of_what_was_sent() -> None:
    """Compressing x repeatedly with the error carried: the decompressed messages add up to
    the inputs' sum up to one step's error, the property 1-bit Adam relies on."""
    gen = torch.Generator().manual_seed(0)
    error = torch.zeros(4096)
    sent = torch.zeros(4096)
    total = torch.zeros(4096)
    for _ in range(50):
        x = torch.randn(4096, generator=gen)
        total += x
        bits, scale = sign_compress(x, error)
        sent += sign_decompress(bits, scale, 4096)
    torch.testing.assert_close(sent + error, total, rtol=0, atol=1e-4)


def test_bad_inputs_name_the_argument() -> None:
    ops = op(torch.device("cpu"))
    x = torch.randn(16)
    scale = torch.ones(1)
    with pytest.raises(RuntimeError, match=r"bits has 3 bytes; 16 elements pack into 2"):
        ops.pack(x, None, scale, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"err has dtype .*; error-feedback buffers are float32"):
        ops.pack(x, torch.zeros(16, dtype=torch.float64), scale, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="scale must be a one-element float32 tensor"):
        ops.pack(x, None, torch.ones(2), torch.empty(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="x has dtype Long"):
        ops.sum_squares(torch.ones(4, dtype=torch.long), None)
    with pytest.raises(ValueError, match="needs the `out` to add to"):
        sign_decompress(torch.empty(2, dtype=torch.uint8), scale, 16, accumulate=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_the_cpu_kernel(dtype: torch.dtype) -> None:
    for n in SIZES:
        x = torch.randn(n).to(dtype)
        err_cpu = torch.randn(n) * 0.1
        err_gpu = err_cpu.cuda()
        bits_c, scale_c = sign_compress(x, err_cpu)
        bits_g, scale_g = sign_compress(x.cuda(), err_gpu)
        assert torch.equal(bits_g.cpu(), bits_c)
        torch.testing.assert_close(scale_g.cpu(), scale_c, rtol=1e-6, atol=0)
        torch.testing.assert_close(err_gpu.cpu(), err_cpu, rtol=1e-5, atol=1e-6)
        out = sign_decompress(bits_g, scale_g, n)
        torch.testing.assert_close(out.cpu(), sign_decompress(bits_c, scale_c, n))

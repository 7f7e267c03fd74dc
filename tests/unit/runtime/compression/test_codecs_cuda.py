"""The gradient codecs on CUDA tensors (the CUDA packbits kernels for signs, torch ops for
2-bit and top-k) against the same codec run on the CPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.runtime.compression import HuffmanRows, SignCodec, TopKCodec, TwoBitCodec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

CODECS = [SignCodec(), TwoBitCodec(), TopKCodec(0.05), TopKCodec(1.0)]
IDS = ["1bit", "2bit", "topk-5%", "topk-all"]
# Odd sizes for the byte tails, and one past the top-k sampling threshold.
SIZES = [1, 7, 8, 1003, 65_543, 300_001]


def encode_decode(codec, x: torch.Tensor, error: torch.Tensor):
    out = torch.empty(codec.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    codec.encode(x, error, out)
    dec = torch.zeros(x.numel(), device=x.device)
    codec.decode(out, x.numel(), dec, 1.0, False)
    return out, dec


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_codec_matches_the_cpu(codec, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    err_cpu = torch.randn(n, generator=g) * 0.1
    err_gpu = err_cpu.cuda()
    y = (x + err_cpu).clone()
    _, dec_cpu = encode_decode(codec, x, err_cpu)
    out_gpu, dec_gpu = encode_decode(codec, x.cuda(), err_gpu)
    # error feedback exact on the GPU: what decodes plus the new error is the input
    torch.testing.assert_close((dec_gpu + err_gpu).cpu(), y, rtol=0, atol=1e-5)
    if isinstance(codec, TwoBitCodec):
        # the level cut is a mean whose summation order differs by device: a value sitting
        # on it may take the other level, nothing more
        differ = (dec_gpu.cpu() != dec_cpu) & ~torch.isclose(dec_gpu.cpu(), dec_cpu)
        assert differ.sum() <= max(1, n // 10_000), int(differ.sum())
        torch.testing.assert_close(dec_gpu.abs().unique().cpu(), dec_cpu.abs().unique())
    else:
        torch.testing.assert_close(dec_gpu.cpu(), dec_cpu, rtol=1e-6, atol=1e-6)
    # decode's weight and accumulate on the GPU
    acc = torch.ones(n, device="cuda")
    codec.decode(out_gpu, n, acc, 0.5, True)
    torch.testing.assert_close(acc, 1 + 0.5 * dec_gpu)


def test_topk_rows_made_on_the_gpu_code_on_the_host() -> None:
    codec, rows = TopKCodec(0.01), HuffmanRows()
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(3)).cuda()
    payload, _ = encode_decode(codec, x, torch.zeros_like(x))
    stream = rows.encode(payload.cpu())
    assert torch.equal(rows.decode(stream), payload.cpu())
    assert stream.numel() < 0.8 * payload.numel()

"""The transformer op's CUDA kernels against its CPU kernels on the same inputs (dropout masks
bit for bit), and the layer on a GPU against the layer on the CPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from deepspeed_ext.ops.transformer.kernels import CPUKernels, CUDAKernels, kernels_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def both(name, *args):
    """The kernel on the CPU and on the GPU; results back on the CPU, as float."""
    cpu = getattr(CPUKernels, name)(*args)
    gpu = getattr(CUDAKernels, name)(*[a.cuda() if torch.is_tensor(a) else a for a in args])
    pair = lambda a, b: (a.float(), b.cpu().float())  # noqa: E731
    if isinstance(cpu, tuple):
        return [pair(a, b) for a, b in zip(cpu, gpu)]
    return [pair(cpu, gpu)]


# 96 columns take the 16-byte pack path, 99 the element path
@pytest.mark.parametrize("width", [96, 99])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_matches_the_cpu(dtype, width):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, width, generator=g) * 2 + 1).to(dtype)
    res, dy = (torch.randn(37, width, generator=g).to(dtype) for _ in range(2))
    gamma, beta = (
        (torch.rand(width, generator=g) + 0.5).to(dtype),
        torch.randn(width, generator=g).to(dtype),
    )
    assert kernels_for(x.cuda()) is CUDAKernels
    checks = [
        ("layer_norm_fwd", (x, gamma, beta, 1e-5)),
        ("bias_gelu_fwd", (x, beta)),
        ("bias_gelu_bwd", (dy, x, beta)),
    ]
    for name, args in checks:
        for a, b in both(name, *args):
            torch.testing.assert_close(b, a, **tol(dtype), msg=name)
    y, mean, rstd = CPUKernels.layer_norm_fwd(x, gamma, beta, 1e-5)
    for src, inv in ((x, False), (y, True)):
        for a, b in both("layer_norm_bwd", dy, src, inv, gamma, beta, mean, rstd):
            torch.testing.assert_close(
                b, a, **dict(tol(dtype), atol=5e-2 if dtype != torch.float32 else 1e-4)
            )
    # keys: one warp's register row (7, 200), the largest (1024), a block per row (1500)
    for sk in (7, 200, 1024, 1500):
        scores = torch.randn(2, 3, 5, sk, generator=g).to(dtype)
        masks = (None, torch.randn(2, 1, sk, generator=g), torch.randn(2, 5, sk, generator=g))
        for mask in masks:
            ((a, b),) = both("softmax_fwd", scores, mask, 0.7)
            torch.testing.assert_close(b, a, **tol(dtype))
        dead = torch.zeros(2, 5, sk)
        dead[1, 2] = -float("inf")  # a row with every key masked attends to nothing
        ((a, b),) = both("softmax_fwd", scores, dead, 0.7)
        assert not b[1, :, 2].any() and not b.isnan().any()
        probs = CPUKernels.softmax_fwd(scores, None, 0.7)
        ((a, b),) = both("softmax_bwd", scores, probs, 0.7)
        torch.testing.assert_close(b, a, **tol(dtype))


@pytest.mark.parametrize("width", [1000, 999])  # packs, and elements one by one
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_masks_are_the_cpus_bit_for_bit(dtype, width):
    x = torch.randn(4, width).to(dtype) + 3  # no zeros of its own
    zeros = torch.zeros(width).to(dtype)
    for name, args in (
        ("dropout", (x, 0.3, 1234, 77)),
        ("dropout", (x, 0.5, 2**61 + 3, 2**40 + 1)),
        ("bias_dropout_residual", (x, zeros, torch.zeros_like(x), 0.3, 9, 5)),
    ):
        ((a, b),) = both(name, *args)
        assert torch.equal(a != 0, b != 0), name
        torch.testing.assert_close(b, a, **tol(dtype))


def test_the_layer_on_a_gpu_matches_the_layer_on_the_cpu():
    cfg = DeepSpeedTransformerConfig(
        batch_size=4,
        hidden_size=64,
        heads=4,
        attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1,
        num_hidden_layers=2,
        initializer_range=0.05,
        seed=3,
    )
    torch.manual_seed(0)
    cpu = DeepSpeedTransformerLayer(cfg)
    gpu = DeepSpeedTransformerLayer(cfg, initial_weights=None)
    gpu.load_state_dict(cpu.state_dict())
    gpu._seed = cpu._seed
    gpu.cuda()
    x = torch.randn(2, 32, 64)
    mask = torch.zeros(2, 1, 1, 32)
    mask[1, ..., -5:] = -10000.0
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    oc, og = cpu(xc, mask), gpu(xg, mask.cuda())
    torch.testing.assert_close(og.cpu(), oc, rtol=1e-4, atol=1e-5)
    gout = torch.randn_like(oc)
    oc.backward(gout)
    og.backward(gout.cuda())
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-4)
    for (n, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-4, atol=1e-4, msg=n)


def test_the_cuda_binding_checks_its_inputs():
    with pytest.raises(RuntimeError, match="x is on cpu; this op runs on CUDA tensors"):
        CUDAKernels.dropout(torch.randn(4), 0.1, 0, 0)
    with pytest.raises(RuntimeError, match="bias has dtype"):
        CUDAKernels.bias_gelu_fwd(torch.randn(2, 4).cuda(), torch.zeros(4).cuda().half())

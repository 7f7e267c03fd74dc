"""cpu_checkpointing on a GPU: the checkpoints' saved inputs leave device memory (pinned host
copies, copied back for the recompute) and the gradients equal those without checkpointing.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.accelerator.cuda import CUDAAccelerator
from deepspeed_ext.runtime import activation_checkpointing as ckpt
from deepspeed_ext.runtime.activation_checkpointing import settings

from .models import Net

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _defaults():
    ckpt.configure(None)
    yield
    ckpt.configure(None)
    settings._current.configured = False


def _run(mode: str, cpu: bool) -> tuple[list[torch.Tensor], int]:
    """Parameter gradients, and the device bytes held between forward and backward."""
    ckpt.configure(None, checkpoint_in_cpu=cpu)
    net = Net(mode, width=1024, depth=4).cuda()
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3)).cuda()
    x.requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(42)
    loss = net(x).pow(2).mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return [p.grad.cpu() for p in net.parameters()] + [x.grad.cpu()], held


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_cpu_checkpointing_moves_saved_inputs_off_the_device(mode):
    ref, held_plain = _run("none", cpu=False)
    on_device, held_ckpt = _run(mode, cpu=False)
    on_host, held_host = _run(mode, cpu=True)
    for a, b, c in zip(ref, on_device, on_host):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    # blocks 2-4 keep a 512 x 1024 fp32 input (2 MiB each) on the device unless on the host
    assert held_ckpt < held_plain
    assert held_ckpt - held_host >= 2 * 2**21, (held_plain, held_ckpt, held_host)

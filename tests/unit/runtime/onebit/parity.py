"""One process, no engine: an optimizer against its reference on the same Linear layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def same_steps(
    reference: Callable[[Any], torch.optim.Optimizer],
    tested: Callable[[Any], torch.optim.Optimizer],
    steps: int = 6,
    each: Callable[[Any, Any], None] = lambda ref, opt: None,
) -> None:
    """Both step `steps` times on the same data; the weights must be equal bit for bit
    (`each` checks more after every step)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    ref, opt = reference(a.parameters()), tested(b.parameters())
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        each(ref, opt)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)

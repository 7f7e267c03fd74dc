"""torch.compile parity: a module traced whole equals itself run eagerly, gradients too."""

from __future__ import annotations

from typing import Any

import torch


def assert_compiled_matches_eager(module: Any, args: tuple[torch.Tensor, ...]) -> None:
    """module(*args) compiled with fullgraph=True (aot_eager) against eager, which runs first
    (as a user's first call would): the output, and the gradients of args under one upstream
    gradient."""
    eager = module(*args)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager)
    g = torch.randn_like(eager)
    torch.testing.assert_close(
        torch.autograd.grad(compiled, args, g), torch.autograd.grad(eager, args, g)
    )

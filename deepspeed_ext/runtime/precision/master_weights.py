"""fp32 master copies of 16-bit model params; the optimizer steps the masters.

For an fp32 model the masters are the model params themselves (no copy).
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = params
        self.is_copy = any(p.dtype != torch.float32 for p in params)
        if self.is_copy:
            self.masters = [
                torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                for p in params
            ]
        else:
            self.masters = list(params)
        self.master_of = {id(p): m for p, m in zip(params, self.masters)}

    def attach_grads(self, grads: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Give each master its (fp32) gradient view for the optimizer step."""
        for p, g in grads:
            m = self.master_of[id(p)]
            m.grad = g if g.dtype == m.dtype else g.to(m.dtype)

    def detach_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.is_copy:
            for p, m in zip(self.model_params, self.masters):
                p.copy_(m)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """After the model's weights changed outside the optimizer (e.g. a checkpoint load)."""
        if self.is_copy:
            for p, m in zip(self.model_params, self.masters):
                m.copy_(p)

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Point a client optimizer built on the model params at the masters instead."""
        if not self.is_copy:
            return
        for group in optimizer.param_groups:
            group["params"] = [self.master_of.get(id(p), p) for p in group["params"]]

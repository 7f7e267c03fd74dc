"""The split backward of zero-bubble schedules: B (input gradients) then W (weight
gradients) give exactly a plain backward's gradients; B computes no weight gradient; graphs
that cannot be cut are reported with the reason (the engine then runs them whole)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed_ext.runtime.pipe.split_backward import SplitPlan, plan_split


class Shared(nn.Module):  # one Linear applied twice along the input path
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


class TwoOutputs(nn.Module):  # the stage sends (h, f(h)) on
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, self.b(h)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def run(t: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(t)))

        return checkpoint(run, x, use_reentrant=self.reentrant)


class Gate(nn.Module):  # parameters met only off the input path, then joining it
    def __init__(self, again: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.randn(8))
        self.q = nn.Parameter(torch.randn(8))
        self.again = again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * (self.p * self.q).exp()
        return y + self.p if self.again else y  # again: p also joins the output directly


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(2, 2, 8)
        return self.norm(x + self.attn(x, x, x)[0]).view(4, 8)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 8))


SPLIT: list[tuple[str, Callable[[], nn.Module], bool]] = [
    ("mlp", _mlp, True),
    ("first-stage", _mlp, False),  # no input needs a gradient: all of it is W
    ("two-outputs", TwoOutputs, True),
    ("two-outputs-first-stage", TwoOutputs, False),
    ("non-reentrant-checkpoint", lambda: Checkpointed(False), True),
    ("gate", lambda: Gate(False), True),
    ("attention", Attention, True),
]


def _run(make: Callable[[], nn.Module], input_grad: bool) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=input_grad)
    x_ref = x.detach().clone().requires_grad_(input_grad)
    outs = model(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    ref_outs = ref(x_ref)
    torch.autograd.backward(list(ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)), grads)
    plan = plan_split(outs, grads, [x] if input_grad else [], list(model.parameters()))
    return model, ref, x_ref, plan


@pytest.mark.parametrize("name,make,input_grad", SPLIT, ids=[c[0] for c in SPLIT])
def test_b_then_w_equals_a_plain_backward(name: str, make: Callable, input_grad: bool) -> None:
    model, ref, x_ref, plan = _run(make, input_grad)
    assert isinstance(plan, SplitPlan), plan
    in_grads = plan.input_pass()
    assert all(p.grad is None for p in model.parameters()), "B computed a weight gradient"
    if input_grad:
        assert torch.equal(in_grads[0], x_ref.grad)
    plan.weight_pass()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, r.grad), n


@pytest.mark.parametrize(
    "make,why",
    [
        (Shared, "used again further along the input path"),
        (lambda: Gate(True), "used again further along the input path"),
        (lambda: Checkpointed(True), "reentrant activation checkpointing"),
    ],
    ids=["shared-weight", "weight-joins-twice", "reentrant-checkpoint"],
)
def test_graphs_that_cannot_be_cut_say_why(make: Callable, why: str) -> None:
    _, _, _, plan = _run(make, True)
    assert isinstance(plan, str) and why in plan


def test_leaf_output_cannot_be_cut() -> None:
    w = nn.Parameter(torch.randn(3))
    assert "leaf" in str(plan_split([w], [torch.ones(3)], [], [w]))


def test_w_runs_after_later_forwards_and_frees_the_graph() -> None:
    """ZB-H1 runs W after other micro-batches' F and B: the captured gradients stay valid."""
    torch.manual_seed(1)
    model = _mlp()
    ref = copy.deepcopy(model)
    plans = []
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    for x in xs:
        out = model(x)
        plan = plan_split([out], [torch.ones_like(out)], [x], list(model.parameters()))
        assert isinstance(plan, SplitPlan)
        plan.input_pass()
        plans.append(plan)
    for plan in plans:
        plan.weight_pass()
    for x in xs:
        ref(x.detach()).backward(torch.ones(4, 8))
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(AssertionError, match="once, after input_pass"):
        plans[0].weight_pass()

"""[Note: per-use aliases of tied parameters] in one process: each use of a parameter two
modules own runs on its own alias, whose gradient reaches the callback as soon as that use's
backward has made it (the head's before the embedding's), the two gradients sum to the
parameter's gradient, and the module gets its own parameter back after every forward, also
one that raised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed_ext.zero.stage3.tied import TiedAliases, tied_names


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.tok.weight
        self.tok.weight.ds_id = 0  # marked partitioned, as stage 3 does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(idx))).logsumexp(-1).sum()


def hooked(model: TiedLM, got: list) -> TiedAliases:
    aliases = TiedAliases(tied_names([model.tok, model.head]), lambda p, a: got.append(a.grad))
    for m in (model.tok, model.head):
        m.register_forward_pre_hook(lambda m, _: aliases.swap_in(m, alias=True))
        m.register_forward_hook(aliases.restore, always_call=True)
    return aliases


def test_each_use_has_its_own_gradient_and_they_sum_to_the_whole():
    torch.manual_seed(0)
    ref = TiedLM()
    model = TiedLM()
    model.load_state_dict(ref.state_dict())
    idx = torch.tensor([[1, 2, 3, 2]])
    ref(idx).backward()
    got: list = []
    aliases = hooked(model, got)
    model(idx).backward()
    assert aliases.uses == 2 and len(got) == 2
    assert model.tok.weight.grad is None  # the parameter itself gets none
    # the head's use comes first: its gradient is dense, the embedding's touches 3 rows
    assert int((got[1].abs().sum(1) > 0).sum()) == 3
    torch.testing.assert_close(got[0] + got[1], ref.tok.weight.grad)
    assert model.head.weight is model.tok.weight


def test_a_forward_that_raises_gives_the_parameter_back():
    model = TiedLM()
    hooked(model, [])

    def boom(x: torch.Tensor) -> torch.Tensor:
        assert model.head.weight is not model.tok.weight  # running on its alias
        raise ValueError("boom")

    model.head.forward = boom
    with pytest.raises(ValueError, match="boom"):
        model(torch.tensor([[1]]))
    assert model.head.weight is model.tok.weight


def test_no_alias_without_grad():
    model = TiedLM()
    aliases = hooked(model, [])
    with torch.no_grad():
        model(torch.tensor([[1]]))
    assert aliases.uses == 0 and model.head.weight is model.tok.weight

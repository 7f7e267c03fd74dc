"""deepspeed.zero.TiledLinear: the same function as the Linear it tiles (forward and
backward, even and uneven splits, split inputs, uncombined outputs, a bias added once), and
trained under ZeRO 3 from zero.Init as the plain model trains."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.zero.tiling import TiledLinear, TiledLinearReturnBias, parts
from tests.helpers.distributed import run_ranks

from . import tiling_runs


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (2, 3), (3, 2), (5, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiles_compute_the_linear(in_splits: int, out_splits: int, bias: bool) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(11, 9, bias=bias)
    tiled = TiledLinear(11, 9, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=ref)  # fmt: skip
    x = torch.randn(3, 5, 11, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    torch.testing.assert_close(tiled(x), ref(x2))
    tiled(x).square().sum().backward()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    rows, cols = parts(9, out_splits), parts(11, in_splits)
    tile = tiled.linears[-1][-1]
    want = ref.weight.grad[rows[-2] : rows[-1], cols[-2] : cols[-1]]
    torch.testing.assert_close(tile.weight.grad, want)
    biases = [t.bias is not None for row in tiled.linears for t in row]
    assert sum(biases) == (out_splits if bias else 0)  # once per output split


def test_parts_are_near_equal_first_ones_wider() -> None:
    assert parts(11, 3) == [0, 4, 8, 11]
    assert parts(9, 4) == [0, 3, 5, 7, 9]


def test_split_inputs_and_uncombined_outputs() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, input_is_already_split=True,
                        combine_out_splits=False, init_linear=ref)  # fmt: skip
    x = torch.randn(2, 6)
    outs = tiled([x[:, :3], x[:, 3:]])
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref(x))
    with pytest.raises(RuntimeError, match="3 input splits given, in_splits is 2"):
        tiled([x[:, :2], x[:, 2:4], x[:, 4:]])


def test_bad_splits_and_mismatched_copies_are_errors() -> None:
    with pytest.raises(RuntimeError, match=r"out_splits=5 must be in \[1, 4\]"):
        TiledLinear(6, 4, out_splits=5)
    with pytest.raises(ValueError, match=r"expected a weight of shape \(4, 6\)"):
        TiledLinear(6, 4).copy_params_from(torch.nn.Linear(4, 6))
    with pytest.raises(ValueError, match="bias=False"):
        TiledLinear(6, 4, bias=False).copy_params_from(torch.nn.Linear(6, 4))


class _ReturnsBias(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant_passes_the_bias_on() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=3, out_splits=2, linear_cls=_ReturnsBias,
                                  init_linear=ref)  # fmt: skip
    x = torch.randn(2, 6)
    out, bias = tiled(x)
    torch.testing.assert_close(out + bias, ref(x))
    torch.testing.assert_close(bias, ref.bias)


def test_zero3_tiled_model_trains_as_the_plain_one() -> None:
    out = run_ranks(tiling_runs.zero3_tiled, 2, 3, timeout=300)
    ref = tiling_runs.reference(3, 2)
    for r in out:
        assert r["tiles"] == 2 * 3 + 4 * 1
        assert r["losses"] == pytest.approx(ref, rel=1e-5)

"""TiledLinear: a linear layer made of in_splits x out_splits smaller linears (upstream's
`deepspeed.zero.TiledLinear`).

Under ZeRO 3 each tile is its own module, so a forward gathers one tile's weight at a time
instead of the whole matrix: the largest transient gather shrinks by in_splits x out_splits.
Output split o is the sum over input splits i of tile (o, i) applied to input split i; only
the last input split's tile has a bias, so the bias is added once. Splits are as even as
possible, the first ones one wider when the features do not divide (upstream's
`partition`).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.utils.splits import partition_uniform as parts


class TiledLinear(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: Any = torch.nn.Linear,
        init_linear: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        for name, splits, features in (
            ("in_splits", in_splits, in_features),
            ("out_splits", out_splits, out_features),
        ):
            if not 1 <= splits <= features:
                raise RuntimeError(
                    f"TiledLinear: {name}={splits} must be in [1, {features}] (the features "
                    "it splits)"
                )
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = parts(in_features, in_splits)
        self.out_parts = parts(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            for i in range(in_splits):
                width = self.in_parts[i + 1] - self.in_parts[i]
                height = self.out_parts[o + 1] - self.out_parts[o]
                tile_bias = bias and i == in_splits - 1  # the bias is added once per output
                row.append(linear_cls(width, height, bias=tile_bias, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def tile(self, out_id: int, in_id: int) -> Any:
        return self.linears[out_id][in_id]  # type: ignore[index]

    def forward(self, input_: Any) -> Any:
        if self.in_splits > 1 and not self.input_is_already_split:
            widths = [self.in_parts[i + 1] - self.in_parts[i] for i in range(self.in_splits)]
            inputs = list(torch.split(input_, widths, dim=-1))
        elif self.in_splits > 1:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise RuntimeError(
                    f"TiledLinear: {len(inputs)} input splits given, in_splits is {self.in_splits}"
                )
        else:
            inputs = [input_]
        outputs = []
        for o in range(self.out_splits):
            acc: Any = None
            for i in range(self.in_splits):
                acc = self._reduce_local_output(i, o, acc, self.tile(o, i)(inputs[i]))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _reduce_local_output(self, in_id: int, out_id: int, current: Any, new: Any) -> Any:
        return new if current is None else current + new

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy a whole linear layer's weight and bias into the tiles (under ZeRO 3 a
        collective: data-parallel rank 0's values reach every rank, as GatheredParameters
        with modifier_rank=0)."""
        from .stage3 import GatheredParameters

        weight, bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"copy_params_from: expected a weight of shape ({self.out_features}, "
                f"{self.in_features}), got {None if weight is None else tuple(weight.shape)}"
            )
        if self.use_bias != (bias is not None):
            raise ValueError(
                f"copy_params_from: this TiledLinear has bias={self.use_bias}, the layer "
                f"given {'has' if bias is not None else 'has no'} bias"
            )
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                tile = self.tile(o, i)
                with GatheredParameters(list(tile.parameters()), modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                    if tile.bias is not None and bias is not None:
                        tile.bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """For linear classes that return (output, bias) as Megatron's do: outputs are summed
    over input splits, the bias of the tile that has one is passed on, and the output
    splits are joined as (concatenated outputs, concatenated biases or None)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current: Any, new: Any) -> Any:
        if not (isinstance(new, tuple) and len(new) == 2):
            raise RuntimeError(
                "TiledLinearReturnBias: linear_cls must return (output, bias), got "
                f"{type(new).__name__}"
            )
        out, b = new
        if current is None:
            return out, b
        old_out, old_b = current
        return old_out + out, b if b is not None else old_b

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensors = torch.cat([o for o, _ in outputs], dim=-1)
        biases = [b for _, b in outputs]
        bias = torch.cat(biases, dim=-1) if all(b is not None for b in biases) else None
        return tensors, bias

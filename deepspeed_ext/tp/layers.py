"""Sliced linear layers under upstream's names: LinearLayer (column-parallel) and
LinearAllreduce (row-parallel).

Each takes the place of a torch Linear or a Hugging Face Conv1D (GPT-2's, weight stored
[in, out]) and keeps that module's own Parameter objects, their values cut to this rank's
slice ([Note: tensor slices]): an optimizer built on the model before deepspeed.initialize
still points at them, and state_dict keys stay the model's. A sliced Parameter carries
`ds_tensor_slice` (how to make it whole again, for exports) and Megatron's
`tensor_model_parallel = True`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from deepspeed_ext.comm import AxisGroup

from .collectives import copy_to, gather_from, reduce_from
from .slicing import TensorSlice


def is_conv1d(module: torch.nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D (a linear layer with its weight transposed),
    recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear_like(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or is_conv1d(module)


def out_dim(module: torch.nn.Module) -> int:
    """The weight dim holding the output features (0 for Linear, 1 for Conv1D)."""
    return 1 if is_conv1d(module) else 0


@torch.no_grad()
def _cut(p: torch.nn.Parameter, spec: TensorSlice) -> None:
    if getattr(p, "ds_tensor_slice", None) is not None:
        return  # a tied weight, cut already for the other module holding it
    p.data = spec.local(p.data)
    p.ds_tensor_slice = spec  # type: ignore[attr-defined]
    p.tensor_model_parallel = True  # type: ignore[attr-defined]


class _Sliced(torch.nn.Module):
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(self, module: torch.nn.Module, axis: AxisGroup) -> None:
        super().__init__()
        weight, bias = module.weight, module.bias
        assert isinstance(weight, torch.nn.Parameter)
        assert bias is None or isinstance(bias, torch.nn.Parameter)
        self.weight = weight
        self.bias = bias
        self.transposed = is_conv1d(module)
        self.axis = axis

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            out = torch.matmul(x, self.weight)
            return out + bias if bias is not None else out
        return F.linear(x, self.weight, bias)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[0 if self.transposed else 1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1 if self.transposed else 0])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_size={self.axis.size}"
        )


class LinearLayer(_Sliced):
    """Column-parallel: the weight's output features are cut; the input is whole on every
    rank and the output is this rank's slice (whole again with gather_output)."""

    def __init__(
        self,
        module: torch.nn.Module,
        axis: AxisGroup,
        weight_slice: TensorSlice,
        bias_slice: TensorSlice | None,
        gather_output: bool = False,
    ) -> None:
        super().__init__(module, axis)
        _cut(self.weight, weight_slice)
        if self.bias is not None and bias_slice is not None:
            _cut(self.bias, bias_slice)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(copy_to(x, self.axis), self.bias)
        return gather_from(out, self.axis) if self.gather_output else out


class LinearAllreduce(_Sliced):
    """Row-parallel: the weight's input features are cut; the input is this rank's slice
    (a column-parallel layer's output), the partial products are summed over the tensor
    group, then the bias (whole on every rank) is added once."""

    def __init__(self, module: torch.nn.Module, axis: AxisGroup, weight_slice: TensorSlice) -> None:
        super().__init__(module, axis)
        _cut(self.weight, weight_slice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from(self._matmul(x, None), self.axis)
        return out + self.bias if self.bias is not None else out


def _check_cuttable(module: torch.nn.Embedding) -> None:
    if module.max_norm is not None or module.sparse:
        raise ValueError(
            "a vocabulary-parallel embedding with max_norm or sparse gradients is not "
            "built; leave the embedding whole (a partition_config skip rule)"
        )


def _lookup(
    ids: torch.Tensor,
    weight: torch.Tensor,
    start: int,
    padding: int | None,
    scale_grad_by_freq: bool,
    axis: AxisGroup,
) -> torch.Tensor:
    """Each rank looks up the ids in its rows [start, start + rows) and zeroes the others;
    the sum over the tensor group makes every row's (the gradient reaches each rank's own)."""
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local = (ids - start).masked_fill(outside, 0)
    out = F.embedding(local, weight, padding, scale_grad_by_freq=scale_grad_by_freq)
    return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), axis)


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose vocabulary rows are cut: each rank looks up the ids in its range,
    zeroes the others, and the partial results are summed over the tensor group (the
    gradient reaches each rank's own rows only)."""

    def __init__(
        self, module: torch.nn.Embedding, axis: AxisGroup, weight_slice: TensorSlice
    ) -> None:
        super().__init__()
        _check_cuttable(module)
        weight = module.weight
        assert isinstance(weight, torch.nn.Parameter)
        self.weight = weight
        self.axis = axis
        self.full_vocab = int(weight_slice.full_shape[0])
        _cut(self.weight, weight_slice)
        self.start = axis.rank * int(self.weight.shape[0])
        pad = module.padding_idx
        local = None if pad is None else pad - self.start
        self.local_padding = (
            local if local is not None and 0 <= local < self.weight.shape[0] else None
        )
        self.scale_grad_by_freq = module.scale_grad_by_freq

    @property
    def num_embeddings(self) -> int:
        return self.full_vocab

    @property
    def embedding_dim(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _lookup(
            ids, self.weight, self.start, self.local_padding, self.scale_grad_by_freq, self.axis
        )

    def extra_repr(self) -> str:
        return f"{self.full_vocab}, {self.embedding_dim}, tp_size={self.axis.size}"


class _VocabParallelLookup(torch.nn.Embedding):
    """nn.Embedding's lookup, vocabulary-parallel (VocabParallelEmbedding's), under an
    embedding subclass that computes more around it: in the class vocab_parallel makes,
    the subclass's `super().forward(ids)` lands here (Gemma's scaled embedding
    multiplies this by its embed_scale)."""

    _tp_axis: AxisGroup
    _tp_start: int
    _tp_padding: int | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _lookup(
            ids, self.weight, self._tp_start, self._tp_padding, self.scale_grad_by_freq,
            self._tp_axis,
        )  # fmt: skip


def vocab_parallel(
    module: torch.nn.Embedding, axis: AxisGroup, weight_slice: TensorSlice
) -> torch.nn.Module:
    """The embedding cut by vocabulary. A plain nn.Embedding becomes a VocabParallelEmbedding;
    a subclass with a forward of its own (Gemma's embedding scales what it looks up) keeps
    its class and forward, its lookup made vocabulary-parallel underneath: replacing it
    would drop what its forward adds."""
    if type(module).forward is torch.nn.Embedding.forward:
        return VocabParallelEmbedding(module, axis, weight_slice)
    _check_cuttable(module)
    cls = type(module)
    module.__class__ = type(f"VocabParallel{cls.__name__}", (cls, _VocabParallelLookup), {})
    m = cast(_VocabParallelLookup, module)
    _cut(cast(torch.nn.Parameter, m.weight), weight_slice)
    rows = int(m.weight.shape[0])
    m._tp_axis, m._tp_start = axis, axis.rank * rows
    local = None if m.padding_idx is None else m.padding_idx - m._tp_start
    m._tp_padding = local if local is not None and 0 <= local < rows else None
    return m


def sliced_params(module: torch.nn.Module) -> list[Any]:
    return [p for p in module.parameters() if hasattr(p, "ds_tensor_slice")]

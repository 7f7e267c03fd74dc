"""Where a tensor-parallel rank's slice of a weight lies, and how the slices make the whole.

[Note: tensor slices]
A sliced weight is cut along one dim into `size` equal slices, one per tensor-parallel rank,
rank r holding the r-th. A fused weight (q/k/v in one matrix, gate and up in one) is several
sub-parameters laid end to end along that dim: each sub-parameter is cut on its own and a
rank's slice is its parts of every sub-parameter, in order, so the layer's output keeps the
fused layout the model's code splits (a rank's q, then its k, then its v). Cuts fall on
`granule` boundaries (an attention head's width), so heads stay whole. Pure arithmetic on
tensors: no process group here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SliceError(ValueError):
    """A weight that cannot be cut evenly over the tensor-parallel ranks."""


@dataclass(frozen=True)
class TensorSlice:
    dim: int  # the dim of the full weight that is cut
    parts: tuple[int, ...]  # sub-parameter sizes along `dim` (one entry: not fused)
    size: int  # tensor-parallel ranks
    rank: int  # this rank
    full_shape: tuple[int, ...]

    @staticmethod
    def plan(
        name: str,
        shape: tuple[int, ...],
        dim: int,
        parts: tuple[int, ...] | int | None,
        size: int,
        rank: int,
        granule: int = 1,
        unit: str = "rows",
    ) -> TensorSlice:
        """The slice of a weight of `shape` cut along `dim`; `parts` the fused sub-parameter
        sizes (or their count, all equal; None: one). Raises SliceError naming the weight."""
        if not -len(shape) <= dim < len(shape):
            raise SliceError(f"{name}: cannot cut dim {dim} of a weight of shape {list(shape)}")
        dim %= len(shape)
        total = shape[dim]
        if parts is None:
            sizes: tuple[int, ...] = (total,)
        elif isinstance(parts, int):
            if parts <= 0 or total % parts:
                raise SliceError(
                    f"{name}: dim {dim} ({total}) does not split into {parts} equal "
                    "sub-parameters; check the spec's shape"
                )
            sizes = (total // parts,) * parts
        else:
            sizes = tuple(int(p) for p in parts)
            if sum(sizes) != total:
                raise SliceError(
                    f"{name}: sub-parameter sizes {list(sizes)} add up to {sum(sizes)}, but "
                    f"dim {dim} of its weight is {total}; check the spec's shape"
                )
        for part in sizes:
            if part % granule or (part // granule) % size:
                n = part // granule
                what = f"{n} attention head{'s' * (n != 1)}" if granule > 1 else f"{part} {unit}"
                raise SliceError(
                    f"{name}: {what} cannot be split evenly over {size} tensor-parallel ranks "
                    "(tensor_parallel.autotp_size): pick a size that divides it, or leave "
                    'the layer whole with a partition_config spec of "partition_type": "skip"'
                )
        return TensorSlice(dim, sizes, size, rank, tuple(shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        out = list(self.full_shape)
        out[self.dim] = sum(self.parts) // self.size
        return tuple(out)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a new contiguous tensor)."""
        pieces = []
        start = 0
        for part in self.parts:
            width = part // self.size
            pieces.append(full.narrow(self.dim, start + self.rank * width, width))
            start += part
        return torch.cat(pieces, self.dim).contiguous()

    def full(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's slice (in tensor-parallel rank order)."""
        if len(slices) != self.size:
            raise SliceError(f"expected {self.size} slices, got {len(slices)}")
        pieces: list[torch.Tensor] = []
        start = 0
        for part in self.parts:
            width = part // self.size
            pieces.extend(s.narrow(self.dim, start, width) for s in slices)
            start += width
        return torch.cat(pieces, self.dim)

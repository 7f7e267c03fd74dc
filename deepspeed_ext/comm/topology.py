"""Process topologies: which global rank sits at which coordinate of the parallel layout.

[Note: rank layout]
A topology names its axes outermost first and numbers ranks in row-major order, so the last
axis varies fastest. Upstream's 3D layout is axes ('pipe', 'data', 'model'): tensor-slicing
ranks are consecutive (they exchange the most bytes, so they share a node), then data, then
pipe. For p pipe stages, d data replicas and t tensor slices:

    rank = (pipe * d + data) * t + model

A group along an axis holds the ranks whose other coordinates are equal
(get_axis_comm_lists). This module is pure arithmetic (no process groups): the grid in
comm/grid.py makes the groups from it.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any


class ProcessTopology:
    """Upstream's ProcessTopology: axes (names, outermost first) and their sizes."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be distinct, got {axes}")
        bad = [d for d in dims if int(d) < 1]
        if bad:
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        coords = itertools.product(*[range(d) for d in self.dims])
        # coordinate -> global rank; row-major, the last axis fastest
        self.mapping: dict[Any, int] = {
            self.ProcessCoord(*c): r  # type: ignore[arg-type]
            for r, c in enumerate(coords)
        }
        self._coords = list(self.mapping)  # global rank -> coordinate

    def world_size(self) -> int:
        return len(self._coords)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of an axis; 0 for an axis this topology does not have (as upstream)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        if set(coord) != set(self.axes):
            raise ValueError(
                f"get_rank() needs every axis {self.axes}, got {sorted(coord)}; "
                "use filter_match() for a slice"
            )
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord} is outside the topology {self}")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology {self}")
        return self._coords[rank]

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: tuple[str, ...] | list[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """'model_01' style names used in checkpoint file names."""
        coord = self.get_coord(rank)
        parts = [
            f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit_axes
        ]
        return outer_sep.join(parts)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per group along `axis`: ranks equal in every other coordinate, in
        order of their coordinate on `axis`. [] for an axis the topology lacks."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*[range(self.get_dim(a)) for a in others]):
            base = dict(zip(others, fixed))
            lists.append([self.get_rank(**base, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **criteria: int) -> list[int]:
        """Global ranks whose coordinates match every given axis value."""
        unknown = set(criteria) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match: unknown axes {sorted(unknown)}; axes are {self.axes}")
        return [
            r
            for r, c in enumerate(self._coords)
            if all(getattr(c, k) == v for k, v in criteria.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose coordinate on `axis` is idx (an unknown axis is an error, as
        upstream's; get_axis_comm_lists gives [] for one)."""
        if axis not in self.axes:
            raise ValueError(f"get_axis_list: unknown axis {axis!r}; axes are {self.axes}")
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return str(dict(zip(self.axes, self.dims)))

    __repr__ = __str__


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: data ranks consecutive."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """3D: pipe outermost, then data, then model (tensor slicing) innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def prime_factors(n: int) -> list[int]:
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    if n > 1:
        out.append(n)
    return out


def default_pipe_data_topology(world_size: int) -> PipeDataParallelTopology:
    """Upstream's grid default without a topology: the world's prime factors dealt in turn
    to pipe and data (8 ranks -> 4 stages x 2 replicas)."""
    pp = dp = 1
    for i, f in enumerate(prime_factors(world_size)):
        if i % 2 == 0:
            pp *= f
        else:
            dp *= f
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)

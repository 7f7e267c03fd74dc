"""Block-sparsity layouts for sparse self-attention, with upstream's classes, parameters and
patterns (deepspeed.ops.sparse_attention.sparsity_config).

A layout is an int64 tensor [num_heads, num_blocks, num_blocks]: entry (h, i, j) is 1 when the
queries of block row i attend to the keys of block column j in head h (blocks of `block`
tokens). Patterns are built for head 0 (or every head, with different_layout_per_head) and
copied to the rest.

Random blocks come from a generator seeded by `seed` (default 0) and the head, so every rank
and every run builds the same layout (upstream draws from Python's global `random`). In a
unidirectional layout, local, sliding-window and random blocks never lie after the diagonal;
global ones may, as in upstream's patterns: a block row inside a span of global columns attends
to the whole span (the global ranges of FixedSparsityConfig and VariableSparsityConfig).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_ATTENTION = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in _ATTENTION:
        raise ValueError(f"attention={attention!r}: expected 'unidirectional' or 'bidirectional'")


def _check_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries but global_block_indices has "
            f"{len(starts)}; give one end per start"
        )
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global block range [{s}, {e}): the start must be below the end")


class SparsityConfig:
    """What every pattern shares: the head count, the block size, and whether heads differ."""

    def __init__(
        self, num_heads: int, block: int = 16, different_layout_per_head: bool = False
    ) -> None:
        if num_heads < 1:
            raise ValueError(f"num_heads={num_heads}: must be >= 1")
        if block < 1:
            raise ValueError(f"block={block}: must be >= 1")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        if seq_len % self.block:
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of the block size {self.block}; "
                "pad it (SparseAttentionUtils.pad_to_block_size)"
            )
        n = seq_len // self.block
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        """The pattern, as the steps that set one head's blocks, in order."""
        raise NotImplementedError(f"{type(self).__name__} defines no pattern; use a subclass")

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        steps = self.layout_steps()
        for h in range(self.num_layout_heads):
            for step in steps:
                step(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class _RandomBlocks:
    """num_random_blocks random blocks per row, drawn from a generator seeded by (seed, head):
    the same layout on every rank and in every run."""

    num_random_blocks: int
    attention: str
    seed: int

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + h)
        causal = self.attention == "unidirectional"
        _set_random(layout[h], self.num_random_blocks, causal, gen, "num_random_blocks")
        return layout


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (for testing and comparison)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _windows(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of consecutive local windows: sizes in order, the last size repeated."""
    out, start, k = [], 0, 0
    while start < n:
        size = sizes[min(k, len(sizes) - 1)]
        out.append((start, min(start + size, n)))
        start += size
        k += 1
    return out


def _set_windows(grid: torch.Tensor, windows: list[tuple[int, int]], causal: bool) -> None:
    for s, e in windows:
        block = torch.ones(e - s, e - s, dtype=grid.dtype)
        grid[s:e, s:e] = torch.tril(block) if causal else block


def _set_sliding(grid: torch.Tensor, width: int, causal: bool, name: str) -> None:
    n = grid.shape[0]
    if n < width:
        raise ValueError(
            f"{name}={width} exceeds the {n} blocks of a row; use fewer or a longer sequence"
        )
    half = width // 2
    for row in range(n):
        end = row + 1 if causal else min(row + half + 1, n)
        grid[row, max(0, row - half) : end] = 1


def _set_random(
    grid: torch.Tensor, count: int, causal: bool, gen: torch.Generator, name: str
) -> None:
    n = grid.shape[0]
    if count > n:
        raise ValueError(f"{name}={count} exceeds the {n} blocks of a row; use fewer")
    if count == 0:
        return
    for row in range(n):
        pool = row + 1 if causal else n
        cols = torch.randperm(pool, generator=gen)[: min(count, pool)]
        grid[row, cols] = 1


def _set_global_ranges(
    grid: torch.Tensor,
    starts: Sequence[int],
    ends: Sequence[int] | None,
    causal: bool,
    horizontal: bool,
) -> None:
    """Columns [s, e) attended by every row (from row s on when causal); with horizontal,
    rows [s, e) attend to every column. A negative index counts from the last block, as
    Python's (and upstream's) indexing reads it."""
    n = grid.shape[0]
    for k, s in enumerate(starts):
        if s < 0:
            if s < -n:
                raise ValueError(
                    f"global block index {s} is before the first of the sequence's {n} "
                    f"blocks: give an index in [-{n}, {n})"
                )
            s += n
        if s >= n:
            continue  # past this sequence's blocks
        if ends is None:
            e = s + 1
        else:
            e = ends[k] + n if ends[k] < 0 else min(ends[k], n)
        grid[s if causal else 0 :, s:e] = 1
        if horizontal:
            grid[s:e, :] = 1


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's fixed pattern: local windows of num_local_blocks blocks, and in
    each window num_global_blocks blocks that every later (bidirectional: every) row attends
    to. Global blocks sit at the end of each window; with different_layout_per_head, head h
    takes pattern h % num_different_global_patterns, each one global span further back."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks < 1 or num_global_blocks < 1 or num_local_blocks % num_global_blocks:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} must be a positive multiple of "
                f"num_global_blocks={num_global_blocks}"
            )
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs "
                "different_layout_per_head=True"
            )
        most = num_local_blocks // num_global_blocks
        if not 1 <= num_different_global_patterns <= most:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns}: must be in "
                f"[1, num_local_blocks / num_global_blocks = {most}]"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        windows = _windows(n, [self.num_local_blocks])
        _set_windows(layout[h], windows, self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n, local, g = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        # offset of the global span inside each window: the last span for pattern 0
        first = local - (1 + h % self.num_different_global_patterns) * g
        full = n - n % local  # blocks covered by whole windows
        starts = list(range(first, full, local))
        if full < n:  # a short last window: its span, moved left to fit if needed
            starts.append(min(full + first, n - g))
        causal = self.attention == "unidirectional"
        _set_global_ranges(
            layout[h], starts, [s + g for s in starts], causal, self.horizontal_global_attention
        )
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        return [self.set_local_layout, self.set_global_layout]


class VariableSparsityConfig(_RandomBlocks, SparsityConfig):
    """Local windows of varying sizes (local_window_blocks: the first windows' sizes, the last
    repeated), global blocks at given indices (or [start, end) ranges), and num_random_blocks
    random blocks per row."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if not local_window_blocks or min(local_window_blocks) < 1:
            raise ValueError(f"local_window_blocks={list(local_window_blocks)}: sizes must be >= 1")
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks={num_random_blocks}: must be >= 0")
        _check_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        windows = _windows(layout.shape[1], self.local_window_blocks)
        _set_windows(layout[h], windows, self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_global_ranges(
            layout[h],
            self.global_block_indices,
            self.global_block_end_indices,
            self.attention == "unidirectional",
            self.horizontal_global_attention,
        )
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        return [self.set_random_layout, self.set_local_layout, self.set_global_layout]


class BigBirdSparsityConfig(_RandomBlocks, SparsityConfig):
    """BigBird: num_random_blocks random blocks per row, a sliding window of
    num_sliding_window_blocks blocks, and the first num_global_blocks blocks global in both
    directions (attending and attended)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        for name, v in (
            ("num_random_blocks", num_random_blocks),
            ("num_sliding_window_blocks", num_sliding_window_blocks),
            ("num_global_blocks", num_global_blocks),
        ):
            if v < 0:
                raise ValueError(f"{name}={v}: must be >= 0")
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.seed = seed

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        # BigBird's window is symmetric; a unidirectional layout is cut to the past below
        _set_sliding(layout[h], self.num_sliding_window_blocks, False, "num_sliding_window_blocks")
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n, g = layout.shape[1], self.num_global_blocks
        if g > n:
            raise ValueError(f"num_global_blocks={g} exceeds the {n} blocks of a row; use fewer")
        layout[h, :g, :] = 1
        layout[h, :, :g] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        return [self.set_random_layout, self.set_sliding_window_layout, self.set_global_layout_itc]


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window of num_sliding_window_blocks blocks, and
    global blocks (indices, or [start, end) ranges) attending and attended in both
    directions."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        _check_ranges(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding(layout[h], self.num_sliding_window_blocks, False, "num_sliding_window_blocks")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_global_ranges(
            layout[h], self.global_block_indices, self.global_block_end_indices, False, True
        )
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        return [self.set_sliding_window_layout, self.set_global_layout]


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Purely local attention: each block row attends to the num_sliding_window_blocks blocks
    around it (unidirectional, the default: its half-window of past blocks and itself)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: str = "unidirectional",
    ) -> None:
        super().__init__(num_heads, block)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        causal = self.attention == "unidirectional"
        _set_sliding(layout[h], self.num_sliding_window_blocks, causal, "num_sliding_window_blocks")
        return layout

    def layout_steps(self) -> list[Callable[[int, torch.Tensor], torch.Tensor]]:
        return [self.set_sliding_window_layout]


_MODES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}


def sparsity_config_from_dict(args: dict[str, Any], num_heads: int) -> SparsityConfig:
    """The layout a `sparse_attention` config section describes ({"mode": "fixed", "block":
    16, ...}, as `DeepSpeedConfig.sparse_attention` gives it), for num_heads heads. Keys other
    than the mode are the class's arguments."""
    args = dict(args)
    mode = args.pop("mode", "fixed")
    if mode not in _MODES:
        raise ValueError(f"sparse_attention mode {mode!r}: expected one of {sorted(_MODES)}")
    cls = _MODES[mode]
    try:
        return cls(num_heads=num_heads, **args)
    except TypeError as e:  # a key the class does not take
        raise ValueError(f"sparse_attention mode {mode!r}: {e}") from None


def same_layout(a: SparsityConfig, b: SparsityConfig) -> bool:
    """Whether two configs build the same layouts (same class and arguments)."""

    def norm(c: SparsityConfig) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in vars(c).items()}

    return type(a) is type(b) and norm(a) == norm(b)

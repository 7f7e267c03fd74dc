"""Near-equal splits of a count (pure Python: pipeline partitions, TiledLinear tiles)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from typing import TypeVar

T = TypeVar("T")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """num_parts + 1 boundaries of runs as equal as they can be; the first runs take the
    remainder (upstream's `partition_uniform` / `partition`). Nothing in no parts is [0],
    as upstream; items in no parts, or a negative count, is a ValueError."""
    if num_items < 0 or num_parts < 0:
        raise ValueError(f"partition_uniform({num_items}, {num_parts}): counts must be 0 or more")
    if num_parts == 0:
        if num_items == 0:
            return [0]
        raise ValueError(
            f"partition_uniform({num_items}, 0): {num_items} items need 1 part or more"
        )
    chunk, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if p < extra else 0))
    return parts


def prefix_sum_inc(weights: Iterable[T]) -> list[T]:
    """The inclusive prefix sums of `weights` (upstream's `deepspeed.runtime.utils` helper):
    [3, 4, 5] -> [3, 7, 12]; the input is left as it is."""
    return list(accumulate(weights))

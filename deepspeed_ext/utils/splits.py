"""Near-equal splits of a count (pure Python: pipeline partitions, TiledLinear tiles)."""

from __future__ import annotations


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """num_parts + 1 boundaries of runs as equal as they can be; the first runs take the
    remainder (upstream's `partition_uniform` / `partition`)."""
    chunk, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if p < extra else 0))
    return parts

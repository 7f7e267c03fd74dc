"""`sparse_attention` (legacy; removed upstream in 0.19): block-sparse self-attention layouts.
Present in the config means on."""

from __future__ import annotations

from typing import Literal

from ..types import Bool, Int, Section


class SparseAttentionConfig(Section):
    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    block: Int = 16
    different_layout_per_head: Bool = False
    num_local_blocks: Int = 4
    num_global_blocks: Int = 1
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    horizontal_global_attention: Bool = False
    num_different_global_patterns: Int = 1
    num_random_blocks: Int = 0
    local_window_blocks: tuple[Int, ...] = (4,)
    global_block_indices: tuple[Int, ...] = (0,)
    global_block_end_indices: tuple[Int, ...] | None = None
    num_sliding_window_blocks: Int = 3

    def active(self) -> bool:
        return True

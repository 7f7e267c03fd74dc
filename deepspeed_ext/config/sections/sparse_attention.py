"""`sparse_attention` (legacy; removed upstream in 0.19): block-sparse self-attention layouts.
Present in the config means on: the engine makes the model's self-attention sparse with this
layout ([Note: sparse attention from the config] in deepspeed_ext/runtime/sparse_attention.py).
"""

from __future__ import annotations

from typing import Any, Literal

from ..types import Bool, Int, Section

# The keys each mode's layout uses (upstream's per-mode readers; the bigbird and bslongformer
# layouts also take `attention`, which upstream's reader leaves at its default). A key set
# for a mode that does not use it is refused by name.
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": (
        "block",
        "different_layout_per_head",
        "num_local_blocks",
        "num_global_blocks",
        "attention",
        "horizontal_global_attention",
        "num_different_global_patterns",
    ),
    "variable": (
        "block",
        "different_layout_per_head",
        "num_random_blocks",
        "local_window_blocks",
        "global_block_indices",
        "global_block_end_indices",
        "attention",
        "horizontal_global_attention",
    ),
    "bigbird": (
        "block",
        "different_layout_per_head",
        "num_random_blocks",
        "num_sliding_window_blocks",
        "num_global_blocks",
        "attention",
    ),
    "bslongformer": (
        "block",
        "different_layout_per_head",
        "num_sliding_window_blocks",
        "global_block_indices",
        "global_block_end_indices",
        "attention",
    ),
}


class SparseAttentionConfig(Section):
    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    # the kernels' block sizes: another is refused here, by name, not at initialize
    block: Literal[16, 32, 64, 128] = 16
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

    def unused_keys(self) -> list[str]:
        """Keys set, away from their defaults, that this mode's layout does not use (a
        default written out, as to_dict() does, changes nothing)."""
        used = set(MODE_KEYS[self.mode]) | {"mode"}
        fields = type(self).model_fields
        return sorted(
            k
            for k in self.model_fields_set
            if k not in used and getattr(self, k) != fields[k].get_default()
        )

    def layout_args(self) -> dict[str, Any]:
        """The mode and its layout's arguments, as upstream's config object gives them
        (`DeepSpeedConfig.sparse_attention`): {"mode": ..., "block": ..., ...}."""
        args: dict[str, Any] = {"mode": self.mode}
        for key in MODE_KEYS[self.mode]:
            value = getattr(self, key)
            args[key] = list(value) if isinstance(value, tuple) else value
        return args

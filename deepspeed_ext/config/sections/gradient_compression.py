"""`gradient_compression` (a key DeepSpeed's guides print; upstream has no such section):
compress the data-parallel gradient exchange of a plain optimizer, with error feedback.
Present in the config means on. See README ("compressed gradients")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..types import Bool, Float, Section


class GradientCompressionConfig(Section):
    # 1bit: signs with a scale per chunk ([Note: compressed all-reduce]); topk: the largest
    # |values| as (index, value) pairs; 2bit: a sign and a magnitude level per value
    algorithm: Literal["1bit", "topk", "2bit"] = "1bit"
    # topk: the fraction of each bucket's values sent, in (0, 1]
    topk_ratio: Float = Field(default=0.01, gt=0.0, le=1.0)
    # topk: Huffman-code the pairs
    huffman_coding: Bool = False

    def active(self) -> bool:
        return True

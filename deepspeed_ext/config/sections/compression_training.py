"""`compression_training` (legacy; removed upstream in 0.19): quantization-aware training,
pruning and layer reduction. Per-technique parameters pass through as free dicts."""

from __future__ import annotations

from typing import Any

from ..types import EMPTY, Bool, FreeDict, Int, Section, Str


class GroupConfig(Section):
    params: FreeDict = EMPTY
    # Module-name patterns the group applies to.
    modules: tuple[Str, ...] = ("*",)
    related_modules: Any = None


class TechniqueConfig(Section):
    # enabled, schedule_offset, method, dense_ratio, ... (per technique).
    shared_parameters: FreeDict = EMPTY
    different_groups: dict[str, GroupConfig] = {}

    def active(self) -> bool:
        # a misspelt switch ("enable") meant it on too: this free dict has no key check
        shared = self.shared_parameters
        return any(bool(v) for k, v in shared.items() if str(k).lower().startswith("enabl"))


class LayerReductionConfig(Section):
    enabled: Bool = False
    keep_number_layer: Int | None = None
    module_name_prefix: Str | None = None
    teacher_layer: tuple[Int, ...] | None = None
    other_module_name: tuple[Str, ...] | None = None


class CompressionTrainingConfig(Section):
    weight_quantization: TechniqueConfig = TechniqueConfig()
    activation_quantization: TechniqueConfig = TechniqueConfig()
    sparse_pruning: TechniqueConfig = TechniqueConfig()
    row_pruning: TechniqueConfig = TechniqueConfig()
    head_pruning: TechniqueConfig = TechniqueConfig()
    channel_pruning: TechniqueConfig = TechniqueConfig()
    layer_reduction: LayerReductionConfig = LayerReductionConfig()

    def active(self) -> bool:
        techniques = (
            self.weight_quantization,
            self.activation_quantization,
            self.sparse_pruning,
            self.row_pruning,
            self.head_pruning,
            self.channel_pruning,
            self.layer_reduction,
        )
        return any(t.active() for t in techniques)

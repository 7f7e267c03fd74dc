"""Top-level `curriculum_learning` (legacy; removed upstream in 0.19 in favour of
data_efficiency.data_sampling.curriculum_learning)."""

from __future__ import annotations

from ..types import Bool, FreeDict, Int, Section, Str


class LegacyCurriculumConfig(Section):
    enabled: Bool = False
    # "seqlen" upstream.
    curriculum_type: Str | None = None
    min_difficulty: Int | None = None
    max_difficulty: Int | None = None
    # "fixed_linear", "fixed_root" or "fixed_discrete".
    schedule_type: Str | None = None
    # total_curriculum_step, difficulty_step, root_degree, difficulty, max_step.
    schedule_config: FreeDict | None = None

"""`expert_parallel`: AutoEP, expert parallelism for unmodified MoE models.

Several keys default to "auto", which is a real upstream value here (chosen from the model),
not a placeholder for an integration to fill.
"""

from __future__ import annotations

from ..types import Auto, Bool, Float, Int, Section, Str


class ExpertParallelConfig(Section):
    enabled: Bool = False
    autoep_size: Int = 1
    expert_tensor_parallel_size: Int = 1
    validate_folding_routing: Bool = False
    async_split_plan: Bool = False
    preset_model: Str | None = None
    moe_layer_pattern: Str | None = None
    expert_pattern: Str | None = None
    router_pattern: Str | None = None
    use_grouped_mm: Bool = True
    disable_triton_grouped_mm: Bool = False
    route_norm: Bool | None = None
    route_scale: Float = 1.0
    score_apply: Auto | Str = "auto"
    combine_impl: Auto | Str = "auto"
    row_weighting_impl: Auto | Str = "auto"
    gate_up_impl: Str = "separate"
    comm_backend: Str = "comm"
    comm_num_sm: Int = 12
    comm_qp_margin: Int = 4
    comm_max_tokens_per_rank: Int = 0
    num_expert_groups: Int | None = None
    num_limited_groups: Int | None = None
    score_func: Auto | Str = "auto"
    top_k: Auto | Int = "auto"
    # Upstream rejects any value but null (auxiliary-loss balancing is not supported).
    load_balance_coeff: None = None
    routed_scaling_factor: Auto | Float = "auto"
    expert_w1: Str | None = None
    expert_w2: Str | None = None
    # Absent: the preset's name; null: fused into w1 (so "given" matters: model_fields_set).
    expert_w3: Str | None = None
    num_experts_attr: Str | None = None
    top_k_attr: Str | None = None
    has_shared_experts: Bool | None = None
    shared_experts_pattern: Str | None = None
    shared_experts_gate_pattern: Str | None = None
    expert_activation: Str | None = None

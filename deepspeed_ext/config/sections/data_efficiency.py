"""`data_efficiency`: curriculum learning (data sampling) and random-LTD (data routing)."""

from __future__ import annotations

from ..types import Bool, FreeDict, Int, Section, Str


class CurriculumMetricConfig(Section):
    index_to_sample_path: Str | None = None
    index_to_metric_path: Str | None = None
    # "value" or "percentile".
    difficulty_type: Str | None = None
    # "schedule_based" or "single_cluster".
    clustering_type: Str | None = None
    min_difficulty: Int | None = None
    max_difficulty: Int | None = None
    # "fixed_linear", "fixed_root", "fixed_discrete" or "custom".
    schedule_type: Str | None = None
    # total_curriculum_step, difficulty_step, root_degree, difficulty, max_step.
    schedule_config: FreeDict | None = None


class CurriculumLearningConfig(Section):
    enabled: Bool = False
    data_cluster_path: Str | None = None
    # One entry per metric, keyed by the metric's name.
    curriculum_metrics: dict[str, CurriculumMetricConfig] = {}


class DynamicBatchingConfig(Section):
    enabled: Bool = False
    metrics_path: Str | None = None
    # "linear", "sqrt" or "none".
    lr_scaling_method: Str = "linear"
    min_batch_size: Int = 1
    max_batch_size: Int | None = None
    # "random", "seqlen" or "dataloader".
    sequence_picking_order: Str = "dataloader"
    max_tokens: Int | None = None
    verbose: Bool = False


class DataSamplingConfig(Section):
    enabled: Bool = False
    num_epochs: Int = 1000
    num_workers: Int = 0
    pin_memory: Bool = False
    curriculum_learning: CurriculumLearningConfig = CurriculumLearningConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()


class RandomLTDScheduleConfig(Section):
    min_value: Int | None = None
    max_value: Int | None = None
    schedule_type: Str | None = None
    # require_steps, seq_per_step.
    schedule_config: FreeDict | None = None


class LayerTokenLRScheduleConfig(Section):
    enabled: Bool = False
    total_layer_tokens: Int | None = None
    warmup_type: Str | None = None
    warmup_layer_tokens: Int | None = None


class RandomLTDConfig(Section):
    enabled: Bool = False
    total_layer_num: Int | None = None
    random_ltd_layer_num: Int | None = None
    random_ltd_layer_id: tuple[Int, ...] | None = None
    model_mask_name: Str | None = None
    # "decoder" or "encoder".
    model_type: Str | None = None
    # "batch_seq_dim" or "seq_batch_dim".
    hidden_state_order: Str | None = None
    random_ltd_schedule: RandomLTDScheduleConfig | None = None
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = LayerTokenLRScheduleConfig()
    # Filled in by the engine from the batch sizes.
    micro_batch_size: Int | None = None
    global_batch_size: Int | None = None


class DataRoutingConfig(Section):
    enabled: Bool = False
    random_ltd: RandomLTDConfig = RandomLTDConfig()


class DataEfficiencyConfig(Section):
    enabled: Bool = False
    seed: Int = 1234
    data_routing: DataRoutingConfig = DataRoutingConfig()
    data_sampling: DataSamplingConfig = DataSamplingConfig()

    def active(self) -> bool:
        """Any switch in it: upstream's engine reads the nested ones (random_ltd,
        curriculum_learning) without the top-level `enabled`."""
        sampling = self.data_sampling
        return any(
            (
                self.enabled,
                self.data_routing.enabled,
                self.data_routing.random_ltd.enabled,
                self.data_routing.random_ltd.layer_token_lr_schedule.enabled,
                sampling.enabled,
                sampling.curriculum_learning.enabled,
                sampling.dynamic_batching.enabled,
            )
        )

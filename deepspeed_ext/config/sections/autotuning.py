"""`autotuning`: search ZeRO stage and micro-batch size for the best throughput."""

from __future__ import annotations

from typing import Literal

from ..types import Bool, FreeDict, Int, Section, Str


class ModelInfoConfig(Section):
    profile: Bool = False
    num_params: Int | None = None
    hidden_size: Int | None = None
    num_layers: Int | None = None


class AutotuningConfig(Section):
    enabled: Bool = False
    # Stop early within a ZeRO stage once no better micro-batch size turns up.
    fast: Bool = True
    results_dir: Str = "autotuning_results"
    exps_dir: Str = "autotuning_exps"
    overwrite: Bool = True
    start_profile_step: Int = 3
    end_profile_step: Int = 5
    metric: Literal["latency", "throughput", "flops", "forward", "step"] = "throughput"
    metric_path: Str | None = None
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: Int = 5
    tuner_num_trials: Int = 50
    # Maps autotuning's names to the training script's argument names.
    arg_mappings: FreeDict | None = None
    model_info: ModelInfoConfig | None = None
    model_info_path: Str | None = None
    mp_size: Int = 1
    max_train_batch_size: Int | None = None
    min_train_batch_size: Int = 1
    max_train_micro_batch_size_per_gpu: Int = 1024
    min_train_micro_batch_size_per_gpu: Int = 1
    num_tuning_micro_batch_sizes: Int = 3

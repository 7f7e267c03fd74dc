"""`elasticity` (legacy; removed upstream in 0.19): pick a batch size that works for many
GPU counts."""

from __future__ import annotations

from ..types import Bool, Float, Int, Section


class ElasticityConfig(Section):
    enabled: Bool = False
    max_train_batch_size: Int = 2000
    micro_batch_sizes: tuple[Int, ...] = (2, 4, 6)
    min_gpus: Int = 1
    max_gpus: Int = 10000
    # Minutes before the scheduler may scale again (v0.1); 0: unknown.
    min_time: Int = 0
    prefer_larger_batch: Bool = True
    ignore_non_elastic_batch_info: Bool = False
    version: Float = 0.2
    num_gpus_per_node: Int = 1
    model_parallel_size: Int = 1

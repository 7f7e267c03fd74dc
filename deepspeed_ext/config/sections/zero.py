"""`zero_optimization`: ZeRO stages 0-3 and everything that tunes them.

Key names are upstream's JSON keys (`stage3_max_live_parameters`, not the short attribute
names upstream also accepts; aliases.py maps those). Defaults are upstream's code defaults,
which differ from its docs page in places (sub_group_size 1e9, stage3_prefetch_bucket_size 5e7).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ..types import Bool, FreeDict, Int, Section, Whole
from .leaf_module import LeafModuleConfig, Names
from .offload import OffloadOptimizerConfig, OffloadParamConfig
from .zenflow import ZenFlowConfig

Stage = Annotated[Literal[0, 1, 2, 3], Whole]


class ZeroConfig(Section):
    # 0 = plain data parallel, 1 = optimizer states, 2 = + gradients, 3 = + parameters sharded.
    stage: Stage = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    # None: sized by the runtime (runtime/strategy_factory.py; upstream's fixed default is
    # 500M elements); engine.config reports the size in use.
    reduce_bucket_size: Annotated[Int, Field(gt=0)] | None = None
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: Int = Field(default=500_000_000, ge=0)
    # Unset means "on for stage 3 only" (upstream's rule); resolved to a bool at parse time.
    overlap_comm: Bool | None = None
    compute_grad_norm: Bool = True
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: ZenFlowConfig | None = None
    sub_group_size: Int = Field(default=1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: Int = Field(default=50_000_000, ge=0)
    stage3_param_persistence_threshold: Int = Field(default=100_000, ge=0)
    stage3_model_persistence_threshold: Int = Field(default=sys.maxsize, ge=0)
    stage3_max_live_parameters: Int = Field(default=1_000_000_000, ge=0)
    stage3_max_reuse_distance: Int = Field(default=1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: Int = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    stage3_allgather_sequential: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    parameter_alignment: Bool = False
    zero_hpz_partition_size: Int = Field(default=1, ge=0)
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    memory_efficient_linear: Bool = True
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LeafModuleConfig = LeafModuleConfig()
    # Stage 3 keeps a parameter whole on every rank (as one under the persistence threshold:
    # never gathered; its fp32 master and optimizer state stay partitioned) when the module
    # that owns it directly is of a class in zero_force_param_types, or, with
    # zero_allowed_param_types given, of a class not in it. Classes by name or dotted path.
    zero_allowed_param_types: Names | None = None
    zero_force_param_types: Names = ()
    # Removed upstream in 0.19.x (MiCS, LoCo-ZeRO++); still accepted from older configs.
    mics_shard_size: Int = -1
    mics_hierarchical_params_gather: Bool = False
    zeropp_loco_param: FreeDict | None = None

    @model_validator(mode="after")
    def _resolve_overlap_comm(self) -> Any:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)  # frozen: set once here
        return self

    @property
    def enabled(self) -> bool:
        return self.stage > 0

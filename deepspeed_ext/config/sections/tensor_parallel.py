"""`tensor_parallel`: AutoTP, tensor-parallel training of unmodified (HF) models."""

from __future__ import annotations

from typing import Literal

from ..types import Bool, DtypeName, FreeDict, Int, Section, Str


class TPConfig(Section):
    tp_size: Int = 1
    tp_grain_size: Int = 1


class TensorParallelConfig(Section):
    # The dtype the model is converted to.
    dtype: DtypeName = "fp16"
    # 0 disables AutoTP training.
    autotp_size: Int = 0
    tp_overlap_comm: Bool = False
    vocab_parallel_lm_head: Bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    # Upstream's key is "tp" (attribute tensor_parallel, also accepted: aliases.py).
    tp: TPConfig = TPConfig()
    # Custom layer partitioning rules ({"use_default_specs": ..., "layer_specs": [...]}).
    partition_config: FreeDict | None = None
    # A built-in partitioning preset: "llama", "bloom", "qwen2", ...
    preset_model: Str | None = None
    keep_module_on_host: Bool = False
    # Upstream also accepts "kernel_inject" (aliases.py).
    replace_with_kernel_inject: Bool = False

    def active(self) -> bool:
        return self.autotp_size > 0

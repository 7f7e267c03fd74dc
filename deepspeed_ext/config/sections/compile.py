"""`compile`: DeepCompile, the torch.compile passes that schedule ZeRO's communication."""

from __future__ import annotations

from typing import Literal

from ..types import Bool, Int, Section


class CompileConfig(Section):
    deepcompile: Bool = False
    autoep_non_moe: Bool = False
    free_activation: Bool = False
    # Bytes; in free_activation mode activations at least this large are freed eagerly.
    free_activation_threshold: Int = 10 * 1024 * 1024
    offload_activation: Bool = False
    offload_activation_pin_memory: Bool = True
    offload_opt_states: Bool = False
    double_buffer: Bool = True
    symmetric_memory: Bool = False
    debug_log: Bool = False
    offload_parameters: Bool = False
    sync_before_reduce: Bool = False
    sync_after_reduce: Bool = False
    sync_before_allgather: Bool = False
    sync_after_allgather: Bool = False
    keep_int_input_tensors: Bool = True
    keep_all_input_tensors: Bool = False
    passes: tuple[Literal["z1", "z3", "autosp", "autotp"], ...] | None = None

    def active(self) -> bool:
        return self.deepcompile

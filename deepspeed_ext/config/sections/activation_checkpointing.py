"""`activation_checkpointing`: how deepspeed.checkpointing recomputes activations."""

from __future__ import annotations

from ..types import Bool, Int, Section


class ActivationCheckpointingConfig(Section):
    # Shard saved activations across model-parallel ranks.
    partition_activations: Bool = False
    contiguous_memory_optimization: Bool = False
    # Buffer count for contiguous_memory_optimization; None: unknown in advance.
    number_checkpoints: Int | None = None
    cpu_checkpointing: Bool = False
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False

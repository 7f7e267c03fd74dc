"""`bf16` (old spelling: `bfloat16`): mixed precision with bf16 weights, no loss scaling."""

from __future__ import annotations

from ..types import Bool, Section


class BF16Config(Section):
    enabled: Bool = False
    immediate_grad_update: Bool = False
    # Skip the optimizer step when a gradient overflowed, as fp16 does.
    check_grad_overflow: Bool = True
    bf16_master_weights_and_grads: Bool = False
    # Only with bf16_master_weights_and_grads (checked in checks.py).
    bf16_optimizer_states: Bool = False

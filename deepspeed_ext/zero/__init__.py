"""ZeRO (layer 4): sharded optimizer states and gradients (stages 1 and 2), one concept per
file: layout (who owns what), sharded_group (a param group's flat buffers), reducer
(gradients to their owners), strategy (the engine's interface)."""

from .layout import GroupLayout, plan_group
from .strategy import ZeroStrategy

__all__ = ["GroupLayout", "ZeroStrategy", "plan_group"]

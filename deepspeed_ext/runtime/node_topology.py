"""The `communication` section's topology: the node groups the stage-0 gradient all-reduce
uses ([Note: hierarchical all-reduce]), or None for the flat all-reduce."""

from __future__ import annotations

import os
from typing import Any

from deepspeed_ext import comm
from deepspeed_ext.config import ConfigError
from deepspeed_ext.utils.logging import logger


def gradient_hierarchy(section: Any, data: comm.AxisGroup) -> comm.NodeGroups | None:
    if section.topology != "hierarchical":
        return None
    per_node = section.ranks_per_node
    if per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if not env:
            raise ConfigError(
                "communication.topology 'hierarchical': the ranks per node are unknown (no "
                "LOCAL_WORLD_SIZE from a launcher); set communication.ranks_per_node"
            )
        per_node = int(env)
    groups, why = comm.node_groups(data, per_node)
    if groups is None:
        logger.info(
            f"communication.topology 'hierarchical': the flat all-reduce runs ({why}, "
            f"{per_node} ranks per node)"
        )
    return groups

"""`communication` (a section DeepSpeed's guides print without defining it; defined here and
in the README's "hierarchical all-reduce" row): how the data-parallel gradient all-reduce
crosses nodes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..types import Int, Section


class CommunicationConfig(Section):
    # "flat": one all-reduce over the data-parallel group; "hierarchical": within each node,
    # across nodes piece by piece, within each node again ([Note: hierarchical all-reduce])
    topology: Literal["flat", "hierarchical"] = "flat"
    # ranks on each node (consecutive global ranks); default: the launcher's
    # LOCAL_WORLD_SIZE
    ranks_per_node: Int | None = Field(default=None, ge=1)

    def active(self) -> bool:
        return self.topology != "flat"

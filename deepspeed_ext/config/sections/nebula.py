"""`nebula` (legacy; removed upstream in 0.19): Azure Nebula asynchronous checkpointing."""

from __future__ import annotations

from ..types import Bool, Int, Section, Str


class NebulaConfig(Section):
    enabled: Bool = False
    persistent_storage_path: Str | None = None
    persistent_time_interval: Int = 100
    num_of_version_in_retention: Int = 2
    enable_nebula_load: Bool = True
    nebula_load_path: Str | None = None

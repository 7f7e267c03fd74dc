"""`checkpoint`: checkpoint tag validation, universal checkpoints and the writer engine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..types import Bool, Int, Section, ToUpper


class ParallelWriteConfig(Section):
    # A pipeline stage's data-parallel ranks share writing its layer files (each an even
    # share of the stage's layers) instead of data-parallel rank 0 writing them all.
    pipeline_stage: Bool = False

    def active(self) -> bool:
        return self.pipeline_stage


class WriterConfig(Section):
    type: Annotated[Literal["MOCK", "PYTHON", "FAST"], ToUpper] = "FAST"
    io_buffer_size: Int = Field(default=64 * 1024**2, gt=0)
    io_buffer_double: Bool = True
    show_statistics: Bool = False
    # None: every rank writes its own shard.
    data_parallel: Annotated[Literal["REPLICA", "SOCKET", "MACHINE"], ToUpper] | None = None
    decoupled: Bool = False
    io_multiplier: Int = 1

    def active(self) -> bool:
        return True  # present means on


class CheckpointConfig(Section):
    # What to do when ranks disagree on the checkpoint tag (case-insensitive upstream).
    tag_validation: Annotated[Literal["WARN", "IGNORE", "FAIL"], ToUpper] = "WARN"
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: ParallelWriteConfig = ParallelWriteConfig()
    checkpoint_serialization: Bool = True
    writer: WriterConfig | None = None

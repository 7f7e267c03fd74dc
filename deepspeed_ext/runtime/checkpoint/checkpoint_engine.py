"""Upstream's checkpoint-engine interface: the object a PipelineModule's save_state_dict and
load_state_dir are handed to write and read their layer files with (a subclass overriding
them calls its save/load/makedirs). Files go where the caller says; the engine's save writes
them into a checkpoint's temporary directory, which becomes the tag's directory only once
every rank has written ([Note: atomic checkpoint])."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from .safe_load import load as load_state_file


class CheckpointEngine(ABC):
    """The interface (upstream's names). create/commit bracket one checkpoint's writes."""

    def __init__(self, config_params: Any = None) -> None:
        self.config_params = config_params

    def create(self, info: Any) -> None:
        """A checkpoint is about to be written (nothing to prepare for plain files)."""
        return None

    @abstractmethod
    def save(self, state_dict: Any, path: str) -> None: ...

    @abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any: ...

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def commit(self, info: Any) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: Any) -> None:
        """Upstream's decoupled engines record what to commit; plain files need nothing."""
        return None

    def get_commit_info(self) -> Any:
        return None

    def cleanup(self) -> None:
        """Nothing outstanding: saves are complete when save() returns."""
        return None

    def preserves_storage_sharing(self) -> bool:
        """torch.save writes a view's whole storage: callers clone views first."""
        return True


class TorchCheckpointEngine(CheckpointEngine):
    """torch.save to write; the checkpoint loader to read (weights-only unpickling: a file
    that needs arbitrary code to load is refused with its name)."""

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_state_file(Path(path), map_location or "cpu")  # None: on the host

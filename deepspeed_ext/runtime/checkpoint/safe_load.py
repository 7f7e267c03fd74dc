"""Checkpoint files are read with torch.load(weights_only=True): tensors and plain Python
containers only, so a crafted file cannot run code. What we save is checked against the same
rule at save time, so a checkpoint we write is always one we can read."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.utils.errors import CheckpointError

__all__ = ["CheckpointError", "check_loadable", "load"]


def load(path: Path, map_location: Any = "cpu") -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - name the file and the reason
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor/container checkpoint "
            f"(torch.load weights_only=True said: {str(exc).splitlines()[0]})"
        ) from None


def check_loadable(obj: Any, what: str) -> None:
    """Raise at save time if `obj` would not load under weights_only=True."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"{what} holds an object that a safe (weights_only) load cannot restore: "
            f"{str(exc).splitlines()[0]}. Keep it to tensors, numbers, strings, lists, tuples "
            "and dicts."
        ) from None

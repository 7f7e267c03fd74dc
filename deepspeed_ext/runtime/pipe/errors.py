"""The pipeline engine's own error."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A pipeline engine used as it cannot be (the message says how to use it)."""

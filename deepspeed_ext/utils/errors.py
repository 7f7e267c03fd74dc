"""Errors shared across layers."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded here; the message names the file and
    the way out."""

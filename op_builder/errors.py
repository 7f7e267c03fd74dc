"""The one error type op building raises."""


class OpBuildError(RuntimeError):
    """An op could not be built or loaded; the message names the op and a fix."""

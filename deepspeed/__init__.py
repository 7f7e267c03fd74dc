"""The `deepspeed` face: upstream DeepSpeed's import paths, re-exporting deepspeed_ext.

Nothing is defined here; every object has its one home in deepspeed_ext.
"""

from deepspeed_ext.version import __version__, __version_api__

__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version_api__.split(".")
)
version = __version__

__all__ = ["__version__", "version"]

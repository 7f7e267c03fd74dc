"""deepspeed_ext: a clean-room implementation of DeepSpeed's training system."""

from .version import __version__, __version_api__

__all__ = ["__version__", "__version_api__"]

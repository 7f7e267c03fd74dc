# The upstream DeepSpeed API level implemented, plus our own local label (PEP 440).
__version_api__ = "0.19.8"
__version__ = __version_api__ + "+ext.1"

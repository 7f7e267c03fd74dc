from deepspeed_ext.ops.lamb import FusedLamb

__all__ = ["FusedLamb"]

"""deepspeed.runtime.zero.tiling: TiledLinear (deepspeed_ext/zero/tiling.py)."""

from deepspeed_ext.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["TiledLinear", "TiledLinearReturnBias"]

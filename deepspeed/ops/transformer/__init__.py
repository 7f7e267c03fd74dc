from deepspeed_ext.ops.transformer import (
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    TransformerConfig,
)

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]

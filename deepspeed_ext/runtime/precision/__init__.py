from .dtypes import cast_half, config_dtype
from .loss_scaler import DynamicLossScaler, LossScaleError, StaticLossScaler, make_loss_scaler
from .master_weights import MasterWeights

__all__ = [
    "cast_half",
    "config_dtype",
    "DynamicLossScaler",
    "LossScaleError",
    "MasterWeights",
    "StaticLossScaler",
    "make_loss_scaler",
]

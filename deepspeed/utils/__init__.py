from deepspeed_ext.utils.logging import log_dist, logger

__all__ = ["log_dist", "logger"]

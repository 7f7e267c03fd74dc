"""upstream's deepspeed.launcher.runner (accelerate imports DEEPSPEED_ENVIRONMENT_NAME here)."""

from deepspeed_ext.launcher.runner import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    encode_world_info,
    fetch_hostfile,
    main,
    parse_args,
    parse_inclusion_exclusion,
    parse_resource_filter,
)

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]

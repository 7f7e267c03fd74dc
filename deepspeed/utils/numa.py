from deepspeed_ext.utils.numa import (
    check_for_numactl_pkg,
    get_numa_cores,
    get_numactl_cmd,
    parse_range,
    parse_range_list,
)

__all__ = [
    "check_for_numactl_pkg",
    "get_numa_cores",
    "get_numactl_cmd",
    "parse_range",
    "parse_range_list",
]

"""upstream's deepspeed.launcher.multinode_runner: the multi-node backends."""

from deepspeed_ext.launcher.multinode_runner import (
    PDSH_MAX_FAN_OUT,
    IMPIRunner,
    MPICHRunner,
    MultiNodeRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)

__all__ = [
    "PDSH_MAX_FAN_OUT",
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

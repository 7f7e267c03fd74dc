"""upstream's deepspeed.launcher.constants: the --launcher names."""

from deepspeed_ext.launcher.multinode_runner import PDSH_MAX_FAN_OUT

PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"

__all__ = [
    "IMPI_LAUNCHER",
    "MPICH_LAUNCHER",
    "MVAPICH_LAUNCHER",
    "OPENMPI_LAUNCHER",
    "PDSH_LAUNCHER",
    "PDSH_MAX_FAN_OUT",
    "SLURM_LAUNCHER",
]

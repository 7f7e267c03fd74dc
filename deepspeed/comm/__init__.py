"""`deepspeed.comm`: upstream's collectives (torch.distributed's signatures), re-exported
from deepspeed.comm.comm as upstream does."""

from deepspeed.comm.comm import *  # noqa: F403
from deepspeed.comm.comm import __all__  # noqa: F401

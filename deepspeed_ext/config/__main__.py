"""`python -m deepspeed_ext.config cfg.json --world_size N`."""

import sys

from .validate import validate_cli

sys.exit(validate_cli())

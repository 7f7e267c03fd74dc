"""The DeepSpeed config: parse(dict | JSON path | base64 | DeepSpeedConfig) -> a frozen, typed
DeepSpeedConfig with one model per section (sections/). Torch-free, so the launcher can check a
config before it spawns any rank.

Start here: parse.py (the pipeline), model.py (the root model and what the engine asks of it),
batch.py (the batch-size triad), aliases.py (upstream's deprecated keys).
"""

from .batch import BatchSizes
from .errors import ConfigError, ConfigWarning, DeprecatedConfigKeyWarning
from .model import DeepSpeedConfig
from .parse import ConfigSource, parse
from .validate import validate_cli, validate_config_file

__all__ = [
    "BatchSizes",
    "ConfigError",
    "ConfigSource",
    "ConfigWarning",
    "DeepSpeedConfig",
    "DeprecatedConfigKeyWarning",
    "parse",
    "validate_cli",
    "validate_config_file",
]

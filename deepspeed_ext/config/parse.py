"""parse(): any config source to a frozen, validated DeepSpeedConfig, every problem at once."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import Any, Union

from pydantic import ValidationError

from . import aliases, checks, messages, schema, support
from .errors import ConfigError, ConfigWarning, DeprecatedConfigKeyWarning
from .model import DeepSpeedConfig
from .source import load

ConfigSource = Union[DeepSpeedConfig, Mapping[str, Any], str, "os.PathLike[str]"]


def parse(config: ConfigSource) -> DeepSpeedConfig:
    """A dict, a JSON file path, base64-encoded JSON, or an already parsed config."""
    if isinstance(config, DeepSpeedConfig):
        return config
    data, source = load(config)
    return build(data, source)


def _unknown(path: str, suggestion: str | None) -> str:
    if path in support.NOT_YET:
        return f"{path}: {support.NOT_YET[path]}; remove it"
    hint = f'; did you mean "{suggestion}"?' if suggestion else ""
    return f"{path}: unknown key{hint}"


def _ignored(path: str, suggestion: str | None) -> str:
    return f'{path} (did you mean "{suggestion}"?)' if suggestion else path


def build(
    data: dict[str, Any],
    source: str,
    raw: dict[str, Any] | None = None,
    consistency: bool = True,
) -> DeepSpeedConfig:
    """Validate a config dict (`raw`: what the user originally gave, when `data` is derived;
    consistency=False leaves the cross-section checks to the caller)."""
    rewritten = aliases.rewrite(data)
    for message in rewritten.warnings:
        warnings.warn(f"DeepSpeed config: {message}", DeprecatedConfigKeyWarning, stacklevel=3)
    problems = list(rewritten.errors)
    found = schema.scan(DeepSpeedConfig, rewritten.data)
    # keys of features not built yet are errors even with "strict": false
    problems += [_unknown(path, hint) for path, hint in found.unknown if path in support.NOT_YET]
    found.unknown = [(path, hint) for path, hint in found.unknown if path not in support.NOT_YET]
    if found.unknown and rewritten.data.get("strict", True) is False:
        ignored = ", ".join(_ignored(path, hint) for path, hint in found.unknown)
        warnings.warn(
            f'DeepSpeed config: ignoring {len(found.unknown)} unknown key(s) ("strict": false): '
            + ignored,
            ConfigWarning,
            stacklevel=3,
        )
    elif found.unknown:
        problems += [_unknown(path, hint) for path, hint in found.unknown]
    clean = schema.without_paths(found.known, found.autos)
    try:
        cfg = DeepSpeedConfig.model_validate(clean)
    except ValidationError as e:
        problems += messages.problems(e, clean)
    if problems:
        raise ConfigError(problems, source)
    cfg._raw = copy.deepcopy(raw if raw is not None else data)  # the caller's dict may change
    cfg._canonical = found.known  # built from rewrite()'s deep copy
    cfg._autos = tuple(found.autos)
    cfg._source = source
    problems = checks.consistency(cfg) if consistency else []
    if problems:
        raise ConfigError(problems, source)
    return cfg

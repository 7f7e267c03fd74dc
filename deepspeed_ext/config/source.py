"""Where a config comes from: a dict, a JSON file, or base64-encoded JSON (upstream's way of
passing a config on the command line)."""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f'duplicate key "{key}" in one object')
        out[key] = value
    return out


def load(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the config as a plain dict, a name for it in messages)."""
    if isinstance(config, Mapping):
        return dict(config), "<dict>"
    if isinstance(config, os.PathLike) or os.path.exists(config):
        return _read_file(Path(config)), str(config)
    if not isinstance(config, str):
        raise ConfigError(
            f"expected a dict, a JSON file path or base64 JSON, got {type(config).__name__}"
        )
    decoded = _from_base64(config)
    if decoded is not None:
        return decoded, "<base64>"
    if config.endswith(".json") or os.sep in config:
        raise ConfigError(f"no such config file: {config}")
    raise ConfigError(f"{config[:60]!r} is neither an existing JSON file nor base64-encoded JSON")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"no such config file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        line = text.splitlines()[e.lineno - 1] if e.lineno <= len(text.splitlines()) else ""
        caret = " " * (e.colno - 1) + "^"
        raise ConfigError(
            f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}\n"
            f"    {line}\n    {caret}"
        ) from None
    except ValueError as e:  # a duplicate key
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, not {type(data).__name__}")
    return data


def _from_base64(text: str) -> dict[str, Any] | None:
    """The decoded config, or None when `text` is not base64 JSON (upstream decodes url-safe
    base64, which also reads the standard alphabet)."""
    try:
        data = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None

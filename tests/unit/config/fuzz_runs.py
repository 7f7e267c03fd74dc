"""bench/config_fuzz.py loaded as a module (and a spawned rank's entry into it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_PATH = Path(__file__).resolve().parents[3] / "bench" / "config_fuzz.py"


def load() -> Any:
    spec = importlib.util.spec_from_file_location("config_fuzz", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def initialize_many(cases: list[tuple[dict[str, Any], str]]) -> list[tuple[str, str]]:
    return load().initialize_many(cases)  # type: ignore[no-any-return]

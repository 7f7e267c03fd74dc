"""What a call raised, as text a spawned rank can return to the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def error_text(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    return "no error"

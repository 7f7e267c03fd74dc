"""Count the calls a run makes to module-level functions (a spawned rank patches the module
before the code under test looks the functions up)."""

from __future__ import annotations

from typing import Any


def count_calls(module: Any, names: list[str]) -> dict[str, int]:
    """Wrap each named function of `module` in a counter; returns the live counts."""
    counts = {name: 0 for name in names}
    for name in names:
        real = getattr(module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(module, name, counted)
    return counts

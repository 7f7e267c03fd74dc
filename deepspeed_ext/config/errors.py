"""The config package's error and warning types."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be used; `problems` holds every problem found at once."""

    def __init__(self, problems: str | Iterable[str], source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f" ({self.source})" if self.source else ""
        if len(self.problems) == 1:
            return f"invalid DeepSpeed config{where}: {self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"invalid DeepSpeed config{where}: {len(self.problems)} problems:\n{lines}"


class ConfigWarning(UserWarning):
    """Something in the config was ignored (unknown keys under "strict": false)."""


class DeprecatedConfigKeyWarning(FutureWarning):
    """A deprecated upstream key was accepted and mapped onto its replacement.

    FutureWarning rather than DeprecationWarning: the user wrote the key, so Python must show
    it by default (DeprecationWarning is hidden outside __main__).
    """

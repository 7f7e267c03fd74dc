"""Handles of asynchronous collectives this package returns in place of torch's: one that had
nothing to move, and several (or one with a step to run after it) as one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Completed:
    """The handle an async collective returns where it had nothing to move (a group of one
    rank, or a world of one without a process group): done already, as torch's handle is
    after its wait()."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def result(self) -> list[torch.Tensor]:
        return []

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([])
        return fut


class Joined:
    """Several async handles as one: wait() waits for each, then runs `then` once (the copy
    of a dense buffer back into the caller's view). is_completed() is true only once the
    result is where the caller reads it."""

    def __init__(self, works: list[Any], then: Callable[[], Any] | None = None) -> None:
        self._works = works
        self._then = then

    def _finish(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        if all(w.is_completed() for w in self._works):
            self._finish()
            return True
        return False

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Any:
        return next((e for w in self._works if (e := w.exception()) is not None), None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._works[-1], name)

"""The `deepspeed_ext` logger: rank 0 only by default, quiet unless asked.

Upstream code does `from deepspeed.utils import logger`; the face re-exports this one.
DS_LOG_ALL_RANKS=1 lets every rank log; DS_LOG_LEVEL sets the level (default INFO).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"


def _rank() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                return 0
    return 0


class _RankZeroFilter(logging.Filter):
    """Drops records on ranks other than 0, unless DS_LOG_ALL_RANKS=1 or the record is an
    error (an error on any rank must be seen)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or os.environ.get("DS_LOG_ALL_RANKS") == "1":
            return True
        return _rank() == 0


def _make_logger() -> logging.Logger:
    log = logging.getLogger("deepspeed_ext")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankZeroFilter())
        log.addHandler(handler)
        log.setLevel(os.environ.get("DS_LOG_LEVEL", "INFO").upper())
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message: str, ranks: Iterable[int] | None = (0,), level: int = logging.INFO) -> None:
    """Log on the given ranks only (None or [-1]: every rank), prefixed with the rank."""
    me = _rank()
    chosen = None if ranks is None else list(ranks)
    if chosen is None or -1 in chosen or me in chosen:
        # bypass the rank-0 filter: the caller chose the ranks explicitly
        record = logger.makeRecord(logger.name, level, "", 0, f"[Rank {me}] {message}", (), None)
        for h in logger.handlers:
            if level >= h.level:
                h.emit(record)

"""Metric sinks: JSON lines, CSV, TensorBoard. Each takes (step, {name: value}) records."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Protocol


class Writer(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonLinesWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)  # line-buffered: a crash loses no finished line

    def write(self, step: int, values: dict[str, float]) -> None:
        self.f.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        self.f.close()


class CsvWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.columns: list[str] | None = None
        self.f = open(path, "a", newline="", buffering=1)
        self.w = csv.writer(self.f)

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.columns is None:
            self.columns = ["step", *values]
            if self.path.stat().st_size == 0:
                self.w.writerow(self.columns)
        self.w.writerow([step, *(values.get(c, "") for c in self.columns[1:])])

    def close(self) -> None:
        self.f.close()


class TensorBoardWriter:
    def __init__(self, path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "the 'tensorboard' config section is enabled but the tensorboard package is not "
                "installed: pip install tensorboard (or disable tensorboard.enabled)"
            ) from None
        self.sw = SummaryWriter(log_dir=str(path))

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.sw.add_scalar(f"Train/{k}", v, step)

    def close(self) -> None:
        self.sw.close()


def _dir(section: Any, default_name: str) -> Path:
    base = getattr(section, "output_path", None) or os.path.join(os.getcwd(), "ds_logs")
    return Path(base) / (getattr(section, "job_name", None) or default_name)


def writers_from_config(cfg: Any) -> list[Writer]:
    """Writers for the enabled monitor sections (rank 0 only; the caller decides)."""
    out: list[Writer] = []
    for attr, make, fname in (
        ("jsonl_monitor", JsonLinesWriter, "metrics.jsonl"),
        ("csv_monitor", CsvWriter, "metrics.csv"),
    ):
        section = getattr(cfg, attr, None)
        if section is not None and getattr(section, "enabled", False):
            out.append(make(_dir(section, "deepspeed") / fname))
    tb = getattr(cfg, "tensorboard", None)
    if tb is not None and getattr(tb, "enabled", False):
        out.append(TensorBoardWriter(_dir(tb, "DeepSpeedJobName")))
    return out

"""Metric sinks: JSON lines, CSV, TensorBoard, Weights & Biases, Comet.

Each takes (step, samples, {name: value}) records, on rank 0. JSON lines is ours (one line
per record, step and samples in it, what `ds_report run` reads). The other four keep
upstream's layout, so dashboards built for upstream's runs read ours: tags
`Train/Samples/<name>` against the global sample count, the loss as `train_loss` and the
phase times as `elapsed_time_ms_<phase>`; CSV as one file per tag (`Train_Samples_<name>.csv`,
header `step,<name>`, the step column holding the sample count as upstream's does).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Writer(Protocol):
    def write(self, step: int, samples: int, values: dict[str, float]) -> None: ...

    def write_event(self, tag: str, value: float, step: int) -> None: ...

    def close(self) -> None: ...


_UPSTREAM_NAMES = {
    "loss": "train_loss",
    "forward_ms": "elapsed_time_ms_forward",
    "backward_ms": "elapsed_time_ms_backward",
    "step_ms": "elapsed_time_ms_step",
}


def upstream_tag(name: str) -> str:
    return f"Train/Samples/{_UPSTREAM_NAMES.get(name, name)}"


def missing_package(section: str, package: str, pip_name: str | None = None) -> ImportError:
    return ImportError(
        f"the '{section}' config section is enabled but the {package} package is not "
        f"installed: pip install {pip_name or package} (or set {section}.enabled to false)"
    )


class JsonLinesWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)  # line-buffered: a crash loses no finished line
        self.events_path = path.with_name("events.jsonl")  # the user's own, kept apart
        self.events: Any = None

    def write(self, step: int, samples: int, values: dict[str, float]) -> None:
        self.f.write(json.dumps({"step": step, "samples": samples, **values}) + "\n")

    def write_event(self, tag: str, value: float, step: int) -> None:
        if self.events is None:
            self.events = open(self.events_path, "a", buffering=1)
        self.events.write(json.dumps({"tag": tag, "value": value, "step": step}) + "\n")

    def close(self) -> None:
        self.f.close()
        if self.events is not None:
            self.events.close()


class CsvWriter:
    """One CSV per tag, as upstream's csv_monitor writes them."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir

    def write(self, step: int, samples: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.write_event(upstream_tag(name), value, samples)

    def write_event(self, tag: str, value: float, step: int) -> None:
        path = self.log_dir / (tag.replace("/", "_").replace(" ", "_") + ".csv")
        fresh = not path.exists() or path.stat().st_size == 0
        with open(path, "a", newline="") as f:
            w = csv.writer(f)
            if fresh:
                w.writerow(["step", tag.rsplit("/", 1)[-1]])
            w.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    def __init__(self, path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_package("tensorboard", "tensorboard") from None
        self.sw = SummaryWriter(log_dir=str(path))

    def write(self, step: int, samples: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.sw.add_scalar(upstream_tag(k), v, samples)
        self.sw.flush()

    def write_event(self, tag: str, value: float, step: int) -> None:
        self.sw.add_scalar(tag, value, step)
        self.sw.flush()

    def close(self) -> None:
        self.sw.close()


class WandbWriter:
    def __init__(self, section: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_package("wandb", "wandb") from None
        self.wandb = wandb
        self.run = wandb.init(project=section.project, group=section.group, entity=section.team)

    def write(self, step: int, samples: int, values: dict[str, float]) -> None:
        self.run.log({upstream_tag(k): v for k, v in values.items()}, step=samples)

    def write_event(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """Comet, at most once per `samples_log_interval` samples for each tag (upstream's rule)."""

    def __init__(self, section: Any) -> None:
        try:
            import comet_ml
        except ImportError:
            raise missing_package("comet", "comet_ml", "comet-ml") from None
        self.interval = int(section.samples_log_interval)
        self.experiment = comet_ml.start(
            api_key=section.api_key,
            project=section.project,
            workspace=section.workspace,
            experiment_key=section.experiment_key,
            mode=section.mode,
            online=section.online,
        )
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self._last: dict[str, int] = {}

    def write(self, step: int, samples: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.write_event(upstream_tag(k), v, samples)

    def write_event(self, tag: str, value: float, step: int) -> None:
        last = self._last.get(tag)
        if last is None or step - last >= self.interval:
            self._last[tag] = step
            self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self.experiment.end()


def _dir(section: Any, default_name: str) -> Path:
    base = getattr(section, "output_path", None) or os.path.join(os.getcwd(), "ds_logs")
    return Path(base) / (getattr(section, "job_name", None) or default_name)


def _on(cfg: Any, attr: str) -> Any:
    section = getattr(cfg, attr, None)
    return section if section is not None and getattr(section, "enabled", False) else None


class RankTimes:
    """Every rank's own wall time and compute time per metrics window, one JSON line each,
    beside the jsonl monitor's file (`ranks/rank<N>.jsonl`): what `ds_report run` finds
    stragglers in ([Note: compute time] in comm/waits.py: `blocked` returns the seconds spent
    in communication since its last call). Each rank writes its own file, so nothing is
    gathered and no rank waits for another."""

    def __init__(self, path: Path, rank: int, blocked: Any = None) -> None:
        import socket

        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)
        self.rank = rank
        self.host = socket.gethostname()
        self.blocked = blocked

    def write(self, step: int, steps: int, window_s: float) -> None:
        rec = {"step": step, "steps": steps, "window_s": window_s, "rank": self.rank}
        if self.blocked is not None:
            rec["compute_s"] = max(window_s - self.blocked(), 0.0)
        self.f.write(json.dumps({**rec, "host": self.host}) + "\n")

    def close(self) -> None:
        self.f.close()


def rank_times_from_config(cfg: Any, rank: int, blocked: Any = None) -> RankTimes | None:
    if (s := _on(cfg, "jsonl_monitor")) is None:
        return None
    return RankTimes(_dir(s, "deepspeed") / "ranks" / f"rank{rank}.jsonl", rank, blocked)


# each monitor section and the writer it makes, in the order they write
_MONITORS: dict[str, Callable[[Any], Writer]] = {
    "jsonl_monitor": lambda s: JsonLinesWriter(_dir(s, "deepspeed") / "metrics.jsonl"),
    "csv_monitor": lambda s: CsvWriter(_dir(s, "DeepSpeedJobName")),
    "tensorboard": lambda s: TensorBoardWriter(_dir(s, "DeepSpeedJobName")),
    "wandb": lambda s: WandbWriter(s),
    "comet": lambda s: CometWriter(s),
}


def monitors_enabled(cfg: Any) -> bool:
    """Whether any monitor section is on (the same answer on every rank)."""
    return any(_on(cfg, name) is not None for name in _MONITORS)


def writers_from_config(cfg: Any) -> list[Writer]:
    """Writers for the enabled monitor sections (rank 0 only; the caller decides)."""
    return [make(s) for name, make in _MONITORS.items() if (s := _on(cfg, name)) is not None]


class MonitorMaster:
    """Upstream's `engine.monitor` (deepspeed.monitor.monitor.MonitorMaster): the enabled
    monitors, and `write_events([(tag, value, step), ...])` for a user's own scalars, under
    their own tags (the JSON-lines monitor puts them in events.jsonl beside metrics.jsonl).
    Only rank 0 writes; on the other ranks it has no writers and writes nothing."""

    def __init__(self, writers: list[Writer], enabled: bool) -> None:
        self.writers = writers
        self.enabled = enabled

    def write_events(self, event_list: list[tuple[str, Any, int]]) -> None:
        for event in event_list:
            if len(event) != 3:
                raise ValueError(f"write_events takes (tag, value, step) tuples, not {event!r}")
        for w in self.writers:
            for tag, value, step in event_list:
                w.write_event(str(tag), float(value), int(step))

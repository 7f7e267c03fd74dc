"""A run's metrics as the JSON-lines monitor wrote them (jsonl_monitor's metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A run directory or metrics file the report cannot read; the message says why."""


def find_metrics(path: str | Path) -> Path:
    """The metrics file itself, or the one metrics.jsonl under a run directory."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise ReportError(f"{p}: no such file or directory")
    found = sorted(p.rglob("metrics.jsonl"))
    if not found:
        raise ReportError(
            f"{p}: no metrics.jsonl under it; turn on the jsonl_monitor section "
            '({"jsonl_monitor": {"enabled": true, "output_path": ...}}) and point at its '
            "output_path"
        )
    if len(found) > 1:
        listed = ", ".join(str(f) for f in found)
        raise ReportError(f"{p}: several runs under it ({listed}); name one of them")
    return found[0]


def _json_lines(f: Path) -> list[tuple[int, Any]]:
    """(line number, value) per non-blank line. A last line with no newline yet that does
    not parse is a record the run is still writing: left out, not an error."""
    text = f.read_text()
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                break
            raise ReportError(f"{f}:{n}: not a JSON line ({e.msg})") from None
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    f = find_metrics(path)
    records = []
    for n, rec in _json_lines(f):
        if not isinstance(rec, dict) or "step" not in rec:
            raise ReportError(f"{f}:{n}: a metrics record needs a 'step' field")
        records.append(rec)
    if not records:
        raise ReportError(f"{f}: empty; the run wrote no metrics yet")
    return records


def read_rank_times(metrics_file: Path) -> list[dict[str, Any]]:
    """Every rank's window times (monitor.RankTimes), from ranks/ beside the metrics file;
    empty for a run that did not record them."""
    out: list[dict[str, Any]] = []
    for f in sorted((metrics_file.parent / "ranks").glob("rank*.jsonl")):
        out.extend(rec for _, rec in _json_lines(f))
    return out

"""A fresh clone stands alone: no tracked file points at a path outside the repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUTSIDE = ("../shared", "/work/shared", "shared/ARCHITECTURE", "shared/BENCHMARKS")


def test_no_tracked_file_points_outside_the_repository():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if name == Path(__file__).relative_to(ROOT).as_posix() or path.suffix not in {
            ".py",
            ".md",
            ".toml",
            ".sh",
            ".txt",
            ".cfg",
            ".json",
            ".yaml",
            ".yml",
            "",
        }:
            continue
        try:
            text = path.read_text(errors="ignore")
        except (IsADirectoryError, FileNotFoundError):
            continue
        bad += [f"{name}: {s}" for s in OUTSIDE if s in text]
    assert not bad, "files pointing outside the repository:\n" + "\n".join(bad)

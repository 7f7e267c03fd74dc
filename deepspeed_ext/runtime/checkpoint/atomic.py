"""Crash-safe checkpoint directories.

[Note: atomic checkpoint]
A checkpoint is written into `<save_dir>/.<tag>.tmp`, every file fsynced, then the directory
is renamed to `<save_dir>/<tag>` (an existing one is first renamed aside, then deleted) and
the parent fsynced; `latest` is replaced last, through a temp file and os.replace. A process
killed at any point leaves the previous checkpoint and `latest` intact; a leftover .tmp dir
is cleared by the next save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_dir_for(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.tmp"


def prepare(save_dir: Path, tag: str) -> Path:
    """Fresh temp dir for a save (a stale one from a killed save is removed)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir_for(save_dir, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(save_dir: Path, tag: str) -> Path:
    """fsync everything in the temp dir and move it into place as <tag>."""
    tmp = tmp_dir_for(save_dir, tag)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_path(f)
    _fsync_path(tmp)
    final = save_dir / tag
    old = save_dir / f".{tag}.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(save_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    _fsync_path(save_dir)


def read_latest(load_dir: Path) -> str | None:
    p = load_dir / LATEST
    return p.read_text().strip() if p.exists() else None

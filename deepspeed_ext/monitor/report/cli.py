"""`ds_report run <dir>`: summarize a run's metrics and draw its plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .plots import run_plots
from .read import ReportError, find_metrics, read_rank_times, read_records
from .summarize import stragglers, summarize, summary_text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ds_report run",
        description="Summarize a run from its metrics (jsonl_monitor's metrics.jsonl) and "
        "write its plots.",
    )
    ap.add_argument("path", help="the run's directory (jsonl_monitor output_path) or its file")
    ap.add_argument("--out", help="where the plots go (default: <run>/report)")
    ap.add_argument("--json", action="store_true", help="the summary as JSON")
    ap.add_argument("--no_plots", action="store_true", help="the summary only")
    args = ap.parse_args(argv)
    try:
        source = find_metrics(args.path)
        records = read_records(source)
        rank_times = read_rank_times(source)
    except ReportError as e:
        print(f"ds_report run: {e}", file=sys.stderr)
        return 2
    s = summarize(records)
    s["stragglers"] = stragglers(rank_times)
    plots: list[Path] = []
    if not args.no_plots:
        try:
            plots = run_plots(records, Path(args.out) if args.out else source.parent / "report")
        except ImportError as e:
            print(f"ds_report run: {e} (or pass --no_plots)", file=sys.stderr)
            return 2
        except OSError as e:  # --out a file, or a folder that cannot be made
            print(
                f"ds_report run: cannot write the plots to {e.filename}: {e.strerror}",
                file=sys.stderr,
            )
            return 2
    if args.json:
        print(json.dumps({**s, "plots": [str(p) for p in plots]}, indent=2))
    else:
        print(summary_text(s, str(source)))
        for p in plots:
            print(f"  plot                {p}")
    return 0

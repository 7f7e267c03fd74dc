"""The run report (`ds_report run <dir>`): a run's metrics summarized and plotted."""

from .cli import main
from .plots import line_chart, loss_plot, run_plots
from .read import ReportError, read_records
from .summarize import summarize, summary_text

__all__ = [
    "ReportError",
    "line_chart",
    "loss_plot",
    "main",
    "read_records",
    "run_plots",
    "summarize",
    "summary_text",
]

"""The run's pictures, drawn with matplotlib (an optional dependency: pip install
matplotlib). Every figure is 800 x 450 px with labelled axes, units and a legend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .summarize import PHASES

SIZE_IN, DPI = (8.0, 4.5), 100  # 800 x 450 px


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _axes(xlabel: str, ylabel: str, title: str) -> tuple[Any, Any, Any]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=SIZE_IN, dpi=DPI)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return plt, fig, ax


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def line_chart(
    path: str | Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    right: Mapping[str, Sequence[float]] | None = None,
    right_label: str = "",
) -> Path:
    plt, fig, ax = _axes(xlabel, ylabel, title)
    handles = [ax.plot(x, ys, label=label)[0] for label, ys in series.items()]
    ax.grid(alpha=0.3)
    if right:
        ax2 = ax.twinx()
        for (label, ys), style in zip(right.items(), ("--", ":", "-.")):
            handles += ax2.plot(x, ys, style, color="tab:gray", label=label)
        ax2.set_ylabel(right_label)
    ax.legend(handles=handles, loc="best")
    return _save(plt, fig, path)


def stacked_bars(
    path: str | Path,
    x: Sequence[float],
    parts: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    plt, fig, ax = _axes(xlabel, ylabel, title)
    bottom = [0.0] * len(x)
    width = 0.8 * (min(b - a for a, b in zip(x, x[1:])) if len(x) > 1 else 1.0)
    for label, ys in parts.items():
        ax.bar(x, ys, width=width, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.legend(loc="best")
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def smoothed(values: Sequence[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def loss_plot(path: str | Path, losses: Sequence[float], title: str = "training loss") -> Path:
    """The loss of every optimizer step and its 10-step moving average."""
    steps = list(range(1, len(losses) + 1))
    return line_chart(
        path,
        steps,
        {"loss (per step)": losses, "loss (10-step mean)": smoothed(losses)},
        "optimizer step",
        "cross-entropy loss (nats per token)",
        title,
    )


def run_plots(records: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """loss_lr.png, throughput.png, memory.png, time_breakdown.png: those the metrics
    have data for."""
    out, made = Path(out_dir), []
    steps = [int(r["step"]) for r in records]

    def col(key: str) -> list[float] | None:
        return [float(r[key]) for r in records] if all(key in r for r in records) else None

    loss, lr = col("loss"), col("lr")
    if loss is not None:
        made.append(
            line_chart(
                out / "loss_lr.png",
                steps,
                {"training loss (mean over each print window)": loss},
                "optimizer step",
                "loss",
                "loss and learning rate",
                right={"learning rate": lr} if lr is not None else None,
                right_label="learning rate",
            )
        )
    rates = {k: v for k, v in (("samples/s", col("samples_per_s")),) if v is not None}
    tokens = col("tokens_per_s")
    if rates or tokens:
        made.append(
            line_chart(
                out / "throughput.png",
                steps,
                rates or {"tokens/s": tokens or []},
                "optimizer step",
                "samples per second (all ranks)" if rates else "tokens per second (all ranks)",
                "throughput",
                right={"tokens/s": tokens} if rates and tokens else None,
                right_label="tokens per second (all ranks)",
            )
        )
    mem = col("peak_mem_gib")
    if mem is not None:
        made.append(
            line_chart(
                out / "memory.png",
                steps,
                {"peak allocated memory": mem},
                "optimizer step",
                "GiB",
                "peak memory (rank 0)",
            )
        )
    prev = [0, *steps[:-1]]
    per_step = {
        name: [float(r[key]) / max(1, s - p) for r, s, p in zip(records, steps, prev)]
        for key, name in PHASES
        if all(key in r for r in records)
    }
    if per_step:
        made.append(
            stacked_bars(
                out / "time_breakdown.png",
                steps,
                per_step,
                "optimizer step",
                "milliseconds per step",
                "step-time breakdown",
            )
        )
    return made

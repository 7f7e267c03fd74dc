"""`ds_report run`: a run's metrics summarized (figures checked by hand) and plotted."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from deepspeed_ext.env_report import main as ds_report
from deepspeed_ext.monitor.report import ReportError, read_records, summarize, summary_text


def _record(step: int, **extra: float) -> dict:
    return {
        "step": step,
        "samples": 8 * step,
        "loss": 4.0 / step,
        "lr": 1e-3,
        "samples_per_s": 100.0,
        "peak_mem_gib": 0.5 + step / 100,
        "forward_ms": 200.0,
        "backward_ms": 400.0,
        "step_ms": 100.0,
        "comm_ms": 100.0,
        **extra,
    }


def _run(tmp_path: Path, records: list[dict]) -> Path:
    d = tmp_path / "run" / "job"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "run"


def test_summary_figures_per_step_from_window_totals(tmp_path: Path) -> None:
    # first window: warm-up (slow), left out of the steady figures
    records = [_record(10, samples_per_s=10.0), _record(20), _record(30)]
    s = summarize(read_records(_run(tmp_path, records)))
    assert s["steps"] == 30 and s["samples"] == 240
    assert s["loss"] == {"first": 0.4, "last": 4.0 / 30, "min": 4.0 / 30}
    assert s["samples_per_s"] == 100.0
    # a window: 80 samples at 100/s = 0.8 s over 10 steps
    assert s["step_time_ms"] == pytest.approx(80.0)
    assert s["phase_ms_per_step"] == {"forward": 20.0, "backward": 40.0, "step": 10.0}
    assert s["comm_ms_per_step"] == 10.0 and s["comm_share"] == pytest.approx(0.125)
    assert s["peak_mem_gib"] == pytest.approx(0.8)


def test_a_slow_window_and_a_resumed_run_do_not_bend_the_summary(tmp_path: Path) -> None:
    """Phases were means over windows while the step time is a median: a profiled window's
    forward made it 1138% of the step. A run resumed from step 20 wrote steps 30 and 40
    again after its first 40: a window of -80 samples went into the medians."""
    slow = _record(20, forward_ms=2000.0)
    records = [_record(10), slow, _record(30), _record(40), _record(30), _record(40)]
    s = summarize(read_records(_run(tmp_path, records)))
    assert s["records"] == 4 and s["steps"] == 40
    assert s["phase_ms_per_step"]["forward"] == 20.0
    assert s["step_time_ms"] == pytest.approx(80.0)


def test_a_pipeline_stage_s_sends_and_receives_are_phases(tmp_path: Path) -> None:
    """A pipeline engine's wall_clock_breakdown times its p2p instructions (upstream's names);
    train_batch, which holds every phase, is not one of them."""
    pipe = {"pipe_send_output_ms": 30.0, "pipe_recv_grad_ms": 150.0, "train_batch_ms": 800.0}
    records = [_record(s, **pipe) for s in (10, 20, 30)]
    s = summarize(read_records(_run(tmp_path, records)))
    assert s["phase_ms_per_step"] == {
        "forward": 20.0,
        "backward": 40.0,
        "step": 10.0,
        "pipe_send_output": 3.0,
        "pipe_recv_grad": 15.0,
    }
    assert "    pipe_recv_grad    15.0 ms (19% of the step)" in summary_text(s, "x")


def test_the_command_prints_the_summary_and_writes_every_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run = _run(tmp_path, [_record(s) for s in (10, 20, 30, 40)])
    assert ds_report(["run", str(run)]) == 0
    text = capsys.readouterr().out
    assert "step time           80.0 ms (median)" in text
    assert "backward          40.0 ms (50% of the step)" in text
    assert "communication       10.0 ms per step, 12% of the step" in text
    pngs = sorted((run / "job" / "report").glob("*.png"))
    assert [p.name for p in pngs] == [
        "loss_lr.png",
        "memory.png",
        "throughput.png",
        "time_breakdown.png",
    ]
    for p in pngs:
        head = p.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (800, 450)
    assert ds_report(["run", str(run), "--json", "--no_plots"]) == 0
    assert json.loads(capsys.readouterr().out)["plots"] == []
    (tmp_path / "afile").write_text("")  # --out where no folder can be: named, no traceback
    assert ds_report(["run", str(run), "--out", str(tmp_path / "afile")]) == 2
    assert "ds_report run: cannot write the plots to" in capsys.readouterr().err


def test_unreadable_runs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ReportError, match="no metrics.jsonl under it; turn on the jsonl_monitor"):
        read_records(tmp_path)
    run = _run(tmp_path, [_record(10)])
    bad = run / "job" / "metrics.jsonl"
    bad.write_text(bad.read_text() + "{oops\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not a JSON line"):
        read_records(run)
    # a run still writing: its last line has no newline yet, and is left out, not refused
    bad.write_text(json.dumps(_record(10)) + "\n" + json.dumps(_record(20))[:15])
    assert [r["step"] for r in read_records(run)] == [10]
    (run / "other").mkdir()
    (run / "other" / "metrics.jsonl").write_text(json.dumps(_record(5)) + "\n")
    assert ds_report(["run", str(run)]) == 2
    assert "several runs under it" in capsys.readouterr().err


def _ranks(run: Path, times: dict[int, list[float]]) -> None:
    d = run / "job" / "ranks"
    d.mkdir()
    for rank, ts in times.items():
        lines = [
            json.dumps(
                {"step": 10 * (i + 1), "steps": 10, "window_s": t, "rank": rank, "host": f"h{rank}"}
            )
            for i, t in enumerate(ts)
        ]
        (d / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_rank_slower_than_the_median_is_named_with_its_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path, [_record(s) for s in (10, 20, 30, 40)])
    # the first window (warm-up) is left out: rank 2's slow start does not count
    _ranks(run, {0: [1.0, 1.0, 1.0, 1.0], 1: [1.0, 1.05, 0.95, 1.0], 2: [3.0, 1.02, 1.0, 1.0]})
    assert ds_report(["run", str(run), "--no_plots"]) == 0
    assert "stragglers          none: 3 ranks within 10% of the median over 3 windows" in (
        capsys.readouterr().out
    )
    import shutil

    shutil.rmtree(run / "job" / "ranks")
    _ranks(run, {0: [1.0, 1.0, 1.0, 1.0], 1: [1.0, 1.3, 1.2, 1.25], 2: [1.0, 1.0, 1.0, 1.0]})
    assert ds_report(["run", str(run), "--no_plots"]) == 0
    out = capsys.readouterr().out
    assert "straggler           rank 1 on h1: 25% slower than the median rank" in out
    assert "rank 0" not in out and "rank 2" not in out


@pytest.fixture(scope="module")
def slowed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 3-rank run shared by the tests below: rank 1 computes 40 ms longer per step."""
    from tests.helpers.distributed import run_ranks

    from . import monitor_runs

    out = tmp_path_factory.mktemp("slowed")
    return out, run_ranks(monitor_runs.one_rank_slowed, 3, str(out), timeout=180)


def test_a_rank_slowed_on_purpose_is_named_by_its_compute_time(
    slowed: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Real ranks: the slowed rank's wall times equal the others' (synchronous training),
    its compute times stand out ([Note: compute time])."""
    out_dir, runs = slowed
    steady = [[r for r in run["records"] if r["step"] > 4] for run in runs]
    walls = [sum(r["window_s"] for r in recs) for recs in steady]
    computes = [sum(r["compute_s"] for r in recs) for recs in steady]
    assert max(walls) < 1.2 * min(walls), walls  # the wall clock names no one
    assert computes[1] > 2 * max(computes[0], computes[2]), computes
    assert ds_report(["run", str(out_dir), "--no_plots"]) == 0
    out = capsys.readouterr().out
    assert "straggler           rank 1 on " in out, out
    assert "rank 0" not in out and "rank 2" not in out


def test_slow_node_tolerance_names_the_slowed_rank_while_training(
    slowed: tuple[Path, list[dict[str, Any]]],
) -> None:
    """[Note: slow nodes]: every check on every rank finds rank 1 and only it; rank 0 warns
    once per check with its host, and the metrics carry the figures."""
    _, runs = slowed
    for run in runs:
        assert run["slow"][1:] == [[1], [1], [1]], run["slow"]  # the first window warms up
    warnings, figures = runs[0]["warnings"], runs[0]["figures"]
    assert len(warnings) >= 3 and all(w.startswith("slow node: rank 1 on ") for w in warnings)
    assert "communication.slow_node_tolerance 0.5" in warnings[-1]
    assert figures[-1]["slow_ranks_n"] == 1 and figures[-1]["slowest_compute_x"] > 1.5
    assert runs[1]["warnings"] == []  # only rank 0 says it

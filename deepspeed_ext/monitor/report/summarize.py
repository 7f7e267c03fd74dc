"""What a run's metrics say: throughput, step-time breakdown, memory, comm share.

The metrics line's timings are totals over the window since the previous record
(steps_per_print steps), so per-step figures divide by the steps in each window; a window's
wall time is its samples over its samples/s. The first window holds the warm-up (JIT
builds, allocator growth) and is left out of the throughput and time figures.
"""

from __future__ import annotations

import statistics
from typing import Any

# (metrics key, label): the parts of a step that wall_clock_breakdown times, apart from
# each other; a pipeline engine's also load micro-batches and move activations and
# gradients between stages (a receive includes the wait for the neighbour)
PHASES = (
    ("forward_ms", "forward"),
    ("backward_ms", "backward"),
    ("step_ms", "optimizer step"),
    ("batch_input_ms", "batch input"),
    ("pipe_send_output_ms", "send activations"),
    ("pipe_recv_input_ms", "receive activations"),
    ("pipe_send_grad_ms", "send gradients"),
    ("pipe_recv_grad_ms", "receive gradients"),
)


def _latest_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run resumed from a checkpoint writes its steps again after the ones it left: a
    record whose step is not past the previous one's replaces those from its step on."""
    out: list[dict[str, Any]] = []
    for r in records:
        while out and int(out[-1]["step"]) >= int(r["step"]):
            out.pop()
        out.append(r)
    return out


def _windows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out, prev_step, prev_samples = [], 0, 0
    for r in records:
        w = dict(r)
        w["_steps"] = max(1, int(r["step"]) - prev_step)
        samples = r.get("samples")
        w["_samples"] = int(samples) - prev_samples if samples is not None else None
        prev_step = int(r["step"])
        prev_samples = int(samples) if samples is not None else prev_samples
        out.append(w)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    records = _latest_run(records)
    windows = _windows(records)
    steady = windows[1:] or windows
    out: dict[str, Any] = {
        "records": len(records),
        "steps": int(records[-1]["step"]),
        "samples": records[-1].get("samples"),
    }
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        out["loss"] = {"first": losses[0], "last": losses[-1], "min": min(losses)}
    for key in ("samples_per_s", "tokens_per_s"):
        vals = [w[key] for w in steady if key in w]
        if vals:
            out[key] = statistics.median(vals)
    # step time: a window's wall time over its steps
    step_ms = [
        1e3 * w["_samples"] / w["samples_per_s"] / w["_steps"]
        for w in steady
        if w.get("_samples") and w.get("samples_per_s")
    ]
    if step_ms:
        out["step_time_ms"] = statistics.median(step_ms)
    phases = {
        # medians, as the step time they are shares of: one slow window (a profiled step)
        # put a mean phase above the median step (1138% of the step)
        p[:-3]: statistics.median(w[p] / w["_steps"] for w in steady if p in w)
        for p, _ in PHASES
        if any(p in w for w in steady)
    }
    if phases:
        out["phase_ms_per_step"] = phases
    if any("comm_ms" in w for w in steady):
        comm = statistics.median(w["comm_ms"] / w["_steps"] for w in steady if "comm_ms" in w)
        out["comm_ms_per_step"] = comm
        if step_ms:
            out["comm_share"] = comm / out["step_time_ms"]
    mem = [r["peak_mem_gib"] for r in records if "peak_mem_gib" in r]
    if mem:
        out["peak_mem_gib"] = max(mem)
    return out


STRAGGLER_TOLERANCE = 0.10  # slower than the median rank by more than this, on average


def stragglers(rank_times: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Ranks whose windows took longer than the median rank's by more than the tolerance,
    on average over the windows after the first (the warm-up); None when not recorded.
    Compute time where recorded ([Note: compute time]: in synchronous training every rank's
    wall time is the slowest one's), else wall time."""
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for r in rank_times:
        by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = r
    steps = sorted(by_step)[1:] or sorted(by_step)
    if not steps:
        return None
    ratios: dict[int, list[float]] = {}
    hosts: dict[int, str] = {}
    for step in steps:
        times = by_step[step]
        key = "compute_s" if all("compute_s" in r for r in times.values()) else "window_s"
        mid = statistics.median(r[key] for r in times.values())
        for rank, r in times.items():
            ratios.setdefault(rank, []).append(r[key] / mid if mid > 0 else 1.0)
            hosts[rank] = str(r.get("host", "?"))
    slow = [
        {"rank": rank, "host": hosts[rank], "slower_pct": 100 * (statistics.mean(v) - 1)}
        for rank, v in sorted(ratios.items())
        if statistics.mean(v) > 1 + STRAGGLER_TOLERANCE
    ]
    return {"ranks": len(ratios), "windows": len(steps), "slow": slow}


def summary_text(s: dict[str, Any], source: str) -> str:
    lines = [
        f"run report: {source}",
        f"  steps recorded      {s['steps']} ({s['records']} records)",
    ]
    if s.get("samples") is not None:
        lines.append(f"  samples             {s['samples']}")
    if "loss" in s:
        loss = s["loss"]
        lines.append(
            f"  loss                {loss['first']:.4f} -> {loss['last']:.4f} "
            f"(min {loss['min']:.4f})"
        )
    if "samples_per_s" in s:
        lines.append(
            f"  throughput          {s['samples_per_s']:.1f} samples/s (median, warm-up excluded)"
        )
    if "tokens_per_s" in s:
        lines.append(f"                      {s['tokens_per_s']:.0f} tokens/s")
    if "step_time_ms" in s:
        lines.append(f"  step time           {s['step_time_ms']:.1f} ms (median)")
    if "phase_ms_per_step" in s:
        total = s.get("step_time_ms")
        for name, ms in s["phase_ms_per_step"].items():
            share = f" ({100 * ms / total:.0f}% of the step)" if total else ""
            lines.append(f"    {name:<17} {ms:.1f} ms{share}")
    else:
        lines.append("  step-time breakdown not recorded (turn on wall_clock_breakdown)")
    if "comm_share" in s:
        lines.append(
            f"  communication       {s['comm_ms_per_step']:.1f} ms per step, "
            f"{100 * s['comm_share']:.0f}% of the step"
        )
    elif "comm_ms_per_step" in s:
        lines.append(f"  communication       {s['comm_ms_per_step']:.1f} ms per step")
    else:
        lines.append("  communication not recorded (turn on comms_logger)")
    if "peak_mem_gib" in s:
        lines.append(f"  peak memory         {s['peak_mem_gib']:.2f} GiB")
    st = s.get("stragglers")
    if st is None:
        lines.append(
            "  stragglers          not recorded (each rank's times come with jsonl_monitor)"
        )
    elif not st["slow"]:
        lines.append(
            f"  stragglers          none: {st['ranks']} ranks within "
            f"{100 * STRAGGLER_TOLERANCE:.0f}% of the median over {st['windows']} windows"
        )
    else:
        for r in st["slow"]:
            lines.append(
                f"  straggler           rank {r['rank']} on {r['host']}: "
                f"{r['slower_pct']:.0f}% slower than the median rank"
            )
    return "\n".join(lines)

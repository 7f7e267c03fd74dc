"""deepspeed.comm's configure() and log_summary() over the comms logger
([Note: comms logger] in comms_logging.py)."""

from __future__ import annotations

from typing import Any

from .checked import dist
from .comms_logging import comms_logger, size_string


def straggler_ms(rows: dict[str, dict[int, dict[str, float]]]) -> dict[tuple[str, int], float]:
    mine = {(n, s): r["total_latency_ms"] for n, sizes in rows.items() for s, r in sizes.items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: 0.0 for k in mine}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v - min(d.get(k, v) for d in everyone) for k, v in mine.items()}


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Upstream's deepspeed.comm.configure: from a config's comms_logger section (a parsed
    config, or a dict with a "comms_logger" key), then the keywords given."""
    section = None
    if isinstance(deepspeed_config, dict):
        raw = deepspeed_config.get("comms_logger", {})
        comms_logger.configure(None, **raw)
    elif deepspeed_config is not None:
        section = getattr(deepspeed_config, "comms_logger", None)
        if section is None:
            section = getattr(getattr(deepspeed_config, "typed", None), "comms_logger", None)
        if section is None:
            raise TypeError(
                f"configure(deepspeed_config=...): a {type(deepspeed_config).__name__} has no "
                "comms_logger section; pass a parsed config or a dict"
            )
    comms_logger.configure(
        section, enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug
    )


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """Print the logged collectives on rank 0 (every rank returns its own table). With
    show_straggler it is a collective: call it on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return log_all(print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict)


def log_all(
    print_log: bool = True, show_straggler: bool = False, return_dict: bool = False
) -> dict[str, Any] | None:
    """Print the table of logged collectives. With show_straggler every rank must call
    it (a collective): each row also shows how much of its time is waiting for the
    slowest rank (this rank's total minus the fastest rank's)."""
    rows = comms_logger.summary_rows()
    stragglers = straggler_ms(rows) if show_straggler else {}
    lines = [
        f"{'Comm. Op':<26}{'Message Size':<16}{'Count':>8}{'Total Latency(ms)':>20}"
        f"{'Avg Latency(ms)':>18}{'tput_avg (Gbps)':>18}{'busbw_avg (Gbps)':>18}"
        + (f"{'straggler (ms)':>16}" if show_straggler else "")
    ]
    for name, sizes in rows.items():
        lines.append(name)
        for size, r in sizes.items():
            line = (
                f"{'':<26}{size_string(size):<16}{r['count']:>8}"
                f"{r['total_latency_ms']:>20.2f}{r['avg_latency_ms']:>18.2f}"
                f"{r['algbw_gbps']:>18.2f}{r['busbw_gbps']:>18.2f}"
            )
            if show_straggler:
                line += f"{stragglers.get((name, size), 0.0):>16.2f}"
                r["straggler_ms"] = stragglers.get((name, size), 0.0)
            lines.append(line)
    if print_log:
        print("\n".join(lines))
    return rows if return_dict else None

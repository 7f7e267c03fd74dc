"""The profile as text: summary, aggregated profile per depth, and the module tree."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from .peak import device_peak
from .units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

if TYPE_CHECKING:
    from .profiler import FlopsProfiler, ModuleStats

_RULE = "-" * 78


def _row(label: str, value: Any) -> str:
    return f"{label + ':':<66}{value}"


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds) if seconds > 0 else "n/a"


def _model_dtype_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


def summary_text(p: FlopsProfiler, profile_step: int) -> str:
    root = p._root()
    eng = p.ds_engine
    world = getattr(eng, "world_size", 1)
    dp = getattr(eng, "dp_world_size", None) or 1
    layout = getattr(eng, "layout", None)
    # upstream's mp_size: the tensor-parallel ranks sharing each layer. Pipeline stages
    # hold different layers, so a stage's counts times the stages is not the model's
    mp = layout.tensor.size if layout is not None else 1
    stages = layout.pipe.size if layout is not None else 1
    whole = "model" if stages == 1 else "stage"
    micro = eng.train_micro_batch_size_per_gpu() if eng is not None else None
    gas = eng.gradient_accumulation_steps() if eng is not None else 1
    calls = p.stats[p.model].calls if p.model in p.stats else 0
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size (mp_size),",
        "number of parameters (params), number of multiply-accumulate operations (MACs),",
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        "",
        _row("world size", world),
        _row("data parallel size", dp),
        _row("model parallel size", mp),
    ]
    if stages > 1:
        lines.append(_row("pipeline stages (counts below are this rank's stage)", stages))
    if micro is not None:
        lines.append(_row("batch size per GPU", micro))
    if gas > 1:
        lines.append(_row("micro-batches in the profiled step (counts are their sum)", gas))
    lines += [
        _row("forward passes profiled", calls),
        _row("params per GPU", params_to_string(root.params)),
        _row(f"params of {whole} = params per GPU * mp_size", params_to_string(root.params * mp)),
        _row("fwd MACs per GPU", macs_to_string(root.macs)),
        _row("fwd flops per GPU", number_to_string(root.flops)),
        _row(
            f"fwd flops of {whole} = fwd flops per GPU * mp_size",
            number_to_string(root.flops * mp),
        ),
        _row("fwd latency", duration_to_string(root.duration)),
        _row(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency", _rate(root.flops, root.duration)
        ),
    ]
    total_flops, total_time = float(root.flops), root.duration
    if p.bwd is not None:
        ratio = p.bwd.flops / p.fwd_dispatch.flops if p.fwd_dispatch.flops else None
        lines += [
            _row("bwd flops per GPU (counted as it ran)", number_to_string(p.bwd.flops)),
        ]
        if ratio is not None:
            lines.append(
                _row("bwd / fwd flops of the matrix ops (GEMM, conv, attention)", f"{ratio:.2f}")
            )
        lines += [
            _row("bwd latency", duration_to_string(p.bwd.duration)),
            _row(
                "bwd FLOPS per GPU = bwd flops per GPU / bwd latency",
                _rate(p.bwd.flops, p.bwd.duration),
            ),
        ]
        total_flops += p.bwd.flops
        total_time += p.bwd.duration
        lines.append(
            _row(
                "fwd+bwd FLOPS per GPU = (fwd + bwd flops) / (fwd + bwd latency)",
                _rate(total_flops, total_time),
            )
        )
    if p.step_duration is not None:
        iter_time = total_time + p.step_duration
        lines += [
            _row("step latency", duration_to_string(p.step_duration)),
            _row("iter latency", duration_to_string(iter_time)),
        ]
        if micro is not None and iter_time > 0:
            lines.append(_row("samples/second", f"{micro * gas * dp / iter_time:.2f}"))
    dtype, device = _model_dtype_device(p.model)
    if total_time > 0:
        peak = device_peak(device, dtype)
        achieved = total_flops / total_time
        lines.append(
            _row(
                "achieved FLOPS per GPU / peak",
                f"{100 * achieved / peak.flops_per_s:.1f}% of {flops_to_string(peak.flops_per_s)} "
                f"({peak.source})",
            )
        )
    if p.uncounted:
        names = ", ".join(f"{k} x{v}" for k, v in sorted(p.uncounted.items()))
        lines.append(_row("calls not counted (arguments not understood)", names))
    return "\n".join(lines)


def _depths(model: torch.nn.Module) -> dict[torch.nn.Module, int]:
    return {m: (name.count(".") + 1 if name else 0) for name, m in model.named_modules()}


def aggregated_text(p: FlopsProfiler, module_depth: int = -1, top_modules: int = 1) -> str:
    depths = _depths(p.model)
    by_depth: dict[int, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0.0])
    )
    for module, s in p.stats.items():
        d = depths.get(module)
        if d is None:
            continue
        agg = by_depth[d][type(module).__name__]
        agg[0] += s.params
        agg[1] += s.macs
        agg[2] += s.duration
    max_depth = max(by_depth) if by_depth else 0
    last = max_depth if module_depth < 0 else min(module_depth, max_depth)
    top = max(1, top_modules)
    lines = [
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        "Top modules in terms of params, MACs or fwd latency at different model depths:",
    ]
    for d in range(last + 1):
        rows = by_depth.get(d, {})

        def best(i: int, fmt: Any, rows: dict[str, list[float]] = rows) -> str:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top]
            return "{" + ", ".join(f"'{k}': '{fmt(v[i])}'" for k, v in ranked) + "}"

        lines += [
            f"depth {d}:",
            f"    params      - {best(0, params_to_string)}",
            f"    MACs        - {best(1, macs_to_string)}",
            f"    fwd latency - {best(2, duration_to_string)}",
        ]
    return "\n".join(lines)


def _info(s: ModuleStats, root: ModuleStats) -> str:
    def pct(a: float, b: float) -> str:
        return f"{100 * a / b:.2f}%" if b else "0.00%"

    return (
        f"{params_to_string(s.params)}, {pct(s.params, root.params)} Params, "
        f"{macs_to_string(s.macs)}, {pct(s.macs, root.macs)} MACs, "
        f"{duration_to_string(s.duration)}, {pct(s.duration, root.duration)} latency, "
        f"{_rate(s.flops, s.duration)}"
    )


def detailed_text(p: FlopsProfiler) -> str:
    root = p._root()
    lines = [
        "",
        "------------------------------ Detailed Profile per GPU ------------------------------",
        "Each module profile is listed after its name in the following order:",
        "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
        "percentage of total fwd latency, fwd FLOPS",
        "",
    ]

    def walk(module: torch.nn.Module, name: str, indent: str) -> None:
        head = f"{indent}({name}): " if name else indent
        cls = type(module).__name__
        s = p.stats.get(module)
        info = _info(s, root) if s is not None else "not profiled (ignored)"
        extra = module.extra_repr()
        children = list(module.named_children())
        if not children:
            lines.append(f"{head}{cls}({info}{', ' + extra if extra else ''})")
            return
        lines.append(f"{head}{cls}(")
        lines.append(f"{indent}  {info}{', ' + extra if extra else ''}")
        for child_name, child in children:
            walk(child, child_name, indent + "  ")
        lines.append(f"{indent})")

    walk(p.model, "", "")
    return "\n".join(lines)


def model_profile_text(
    p: FlopsProfiler, profile_step: int, module_depth: int, top_modules: int, detailed: bool
) -> str:
    parts = [summary_text(p, profile_step), aggregated_text(p, module_depth, top_modules)]
    if detailed:
        parts.append(detailed_text(p))
    parts.append(_RULE)
    return "\n".join(parts)

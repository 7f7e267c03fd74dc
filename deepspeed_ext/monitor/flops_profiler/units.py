"""Numbers as the profile prints them: 61.71 k params, 426.52 MMACs, 81.9 TFLOPS, 34.09 us."""

from __future__ import annotations

_PREFIXES = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))


def _scaled(num: float, units: str | None, precision: int) -> tuple[str, str]:
    scale = dict(_PREFIXES)
    if units is None:
        units = next((p for p, s in _PREFIXES if abs(num) >= s), "")
    if units and units not in scale:
        raise ValueError(f"units={units!r}: use one of P, T, G, M, K or '' (or None to choose)")
    return f"{round(num / scale[units] if units else num, precision):g}", units


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """`num` scaled to `units` (one of P, T, G, M, K, "") or the largest prefix that fits."""
    value, prefix = _scaled(num, units, precision)
    return f"{value} {prefix}".rstrip()


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    value, prefix = _scaled(macs, units, precision)
    return f"{value} {prefix}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    value, prefix = _scaled(flops, units, precision)
    return f"{value} {prefix}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    value, prefix = _scaled(params, units, precision)
    return f"{value} {prefix.replace('K', 'k')}".rstrip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    if units is None:
        units = "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"
    factor = {"s": 1.0, "ms": 1e3, "us": 1e6}
    if units not in factor:
        raise ValueError(f"units={units!r}: use one of s, ms, us (or None to choose)")
    return f"{round(seconds * factor[units], precision):g} {units}"

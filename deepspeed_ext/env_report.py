"""ds_report: which ops can run here and why not, and the toolchain they would build with.

Works with no CUDA_HOME, no nvcc and no GPU: every probe reports 'not found' instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from deepspeed_ext.op_builder import ALL_OPS, CPUOpBuilder, cache_root, cpu_features
from deepspeed_ext.op_builder.builder import cuda_nvcc, nvcc_version
from deepspeed_ext.version import __version__


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def op_status() -> list[dict[str, Any]]:
    rows = []
    for name, cls in ALL_OPS.items():
        b = cls()
        compat = b.is_compatible()
        row: dict[str, Any] = {
            "op": name,
            "compatible": bool(compat),
            "reason": compat.reason,
            "prebuilt": b.prebuilt_path() is not None,
            "jit_cached": False,
            "simd": b.simd() if isinstance(b, CPUOpBuilder) else None,
        }
        if compat:
            try:
                row["jit_cached"] = b.cached_path() is not None
            except Exception as exc:  # noqa: BLE001 - a report never fails on one probe
                row["reason"] = f"cache unreadable: {exc}"
        rows.append(row)
    return rows


def environment() -> dict[str, Any]:
    import torch

    from deepspeed_ext.accelerator import get_accelerator

    nvcc = cuda_nvcc()
    try:
        acc = get_accelerator()
        accel = {
            "name": acc._name,
            "backend": acc.communication_backend_name(),
            "device_count": acc.device_count(),
        }
    except Exception as exc:  # noqa: BLE001
        accel = {"error": str(exc)}
    cxx = os.environ.get("CXX", "c++")
    return {
        "deepspeed_ext": {"version": __version__, "path": os.path.dirname(__file__)},
        "python": sys.version.split()[0],
        "torch": {
            "version": torch.__version__,
            "path": os.path.dirname(torch.__file__),
            "cuda": torch.version.cuda,
        },
        "nvcc": {"path": nvcc, "version": nvcc_version(nvcc) if nvcc else None},
        "cuda_home": os.environ.get("CUDA_HOME"),
        "accelerator": accel,
        "simd": {
            "level": _safe(cpu_features.simd_level),
            "best": cpu_features.best_level(),
            "forced": os.environ.get("DS_SIMD") or None,
        },
        "ninja": _first_line(["ninja", "--version"]) if shutil.which("ninja") else None,
        "compiler": _first_line([cxx, "--version"]) if shutil.which(cxx) else None,
        "build_cache": str(_safe(cache_root)),
    }


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"error: {exc}"


def _dots(label: str, width: int = 26) -> str:
    return f"{label} ".ljust(width, ".") + " "


def _colored(line: str) -> str:
    for word, code in (("[OKAY]", 92), ("[YES]", 92), ("[NO]", 93)):
        line = line.replace(word, f"\033[{code}m{word}\033[0m")
    return line


def render(ops: list[dict[str, Any]] | None, env: dict[str, Any], color: bool) -> str:
    def tag(ok: bool, yes: str = "YES") -> str:
        return f"[{yes}]" if ok else "[NO]"

    rule = "-" * 78
    out = [rule, "deepspeed_ext op report", rule]
    if ops is not None:
        out.append(
            "prebuilt = compiled into the install (DS_BUILD_OPS=1); cached = JIT-built already "
            "for this torch/Python; otherwise an op JIT-builds on first use."
        )
        w = max([len("op"), *(len(r["op"]) for r in ops)]) + 2  # sparse_attention_cuda
        out.append(f"{'op':<{w}}{'compatible':<13}{'prebuilt':<11}{'cached':<9}simd")
        for r in ops:
            row = (
                f"{r['op']:<{w}}{tag(r['compatible'], 'OKAY'):<13}{tag(r['prebuilt']):<11}"
                f"{tag(r['jit_cached']):<9}{r['simd'] or '-'}"
            )
            out.append(_colored(row) if color else row)
            if r["reason"]:
                out.append(f"    why not: {r['reason']}")
        out.append(rule)
    t, n, s, a = env["torch"], env["nvcc"], env["simd"], env["accelerator"]
    lines = [
        ("deepspeed_ext", f"{env['deepspeed_ext']['version']} at {env['deepspeed_ext']['path']}"),
        ("python", env["python"]),
        ("torch", f"{t['version']} at {t['path']}"),
        ("torch CUDA", t["cuda"] or "none (CPU build)"),
        ("nvcc", f"{n['version']} at {n['path']}" if n["path"] else "not found"),
        ("CUDA_HOME", env["cuda_home"] or "not set"),
        ("accelerator", ", ".join(f"{k}={v}" for k, v in a.items())),
        (
            "SIMD level",
            f"{s['level']} (best on this CPU: {s['best']}"
            + (f"; forced by DS_SIMD={s['forced']})" if s["forced"] else ")"),
        ),
        ("ninja", env["ninja"] or "not found (pip install ninja)"),
        ("C++ compiler", env["compiler"] or "not found"),
        ("build cache", env["build_cache"]),
    ]
    out += [_dots(k) + str(v) for k, v in lines]
    out.append(rule)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # ds_report run <dir>: a run's report, not the environment's
        from deepspeed_ext.monitor.report import main as run_report

        return run_report(argv[1:])
    ap = argparse.ArgumentParser(
        prog="ds_report",
        description=__doc__,
        epilog="ds_report run <dir>: summarize and plot a run's metrics (ds_report run -h)",
    )
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--hide_operator_status", action="store_true")
    ap.add_argument("--hide_errors_and_warnings", action="store_true")
    args = ap.parse_args(argv)
    ops = None if args.hide_operator_status else op_status()
    env = environment()
    if args.hide_errors_and_warnings and ops is not None:
        for r in ops:
            r["reason"] = None
    if args.json:
        print(json.dumps({"ops": ops, "environment": env}, indent=2))
    else:
        print(render(ops, env, color=sys.stdout.isatty()))
    return 0


def cli_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli_main()

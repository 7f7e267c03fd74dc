"""Benchmark peer: time UPSTREAM DeepSpeed's DeepSpeedCPUAdam step.

Run with the upstream venv's python (see setup_upstream.sh), never with the
project's own environment:

    PY=$(bash bench/peers/setup_upstream.sh)
    $PY bench/peers/upstream_cpu_adam.py --numel $((64*2**20)) --dtype bf16 --reps 5 --threads 2

Prints exactly ONE line of JSON on stdout:
    {"peer": "deepspeed==<version>", "times_s": [...], "numel": N, "dtype": "fp32"|"bf16", ...}
Everything else (DeepSpeed's own logging and prints, op-build output) goes to
stderr. Imports only upstream deepspeed + torch (and the standard library).

--dtype bf16 means bf16 params and grads with fp32 optimizer states (upstream
keeps exp_avg / exp_avg_sq in fp32 for bf16 params).
"""

import argparse
import json
import os
import sys
import time


def _isolate_from_repo() -> None:
    """Keep the project's own `deepspeed` package (repo root on cwd / PYTHONPATH)
    from shadowing upstream: only keep sys.path entries inside this
    interpreter's prefix (the venv) or its base prefix (the stdlib)."""
    roots = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}

    def inside(p: str) -> bool:
        rp = os.path.realpath(p or os.getcwd())
        return any(rp == r or rp.startswith(r + os.sep) for r in roots)

    sys.path[:] = [p for p in sys.path if inside(p)]


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=64 * 2**20, help="total parameter elements")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--tensors", type=int, default=1, help="split numel into this many tensors")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.numel < 1 or a.reps < 1 or a.warmup < 0 or not 1 <= a.tensors <= a.numel:
        ap.error("need numel >= 1, reps >= 1, warmup >= 0, 1 <= tensors <= numel")
    return a


def main() -> int:
    args = _parse()

    # stdout carries only the JSON line. DeepSpeed logs and prints to stdout
    # (Python logging handler, print(), and C++ printf), so point fd 1 at
    # stderr for the whole run and keep a private handle on the real stdout.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    _isolate_from_repo()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR",
        os.environ.get("DS_UPSTREAM_TORCH_EXT") or os.path.join(sys.prefix, "torch_extensions"),
    )
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch  # noqa: E402

    import deepspeed  # noqa: E402
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: E402

    ds_dir = os.path.realpath(os.path.dirname(deepspeed.__file__))
    if not ds_dir.startswith(os.path.realpath(sys.prefix) + os.sep):
        print(
            f"error: imported deepspeed from {ds_dir}, not from this venv ({sys.prefix})",
            file=sys.stderr,
        )
        return 2

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dt = torch.float32 if args.dtype == "fp32" else torch.bfloat16

    base, extra = divmod(args.numel, args.tensors)
    sizes = [base + (i < extra) for i in range(args.tensors)]
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n, dtype=dt).uniform_(-1.0, 1.0))
        p.grad = torch.empty(n, dtype=dt).normal_(0.0, 1e-2)
        params.append(p)

    print(
        f"[upstream_cpu_adam] deepspeed {deepspeed.__version__} from {ds_dir}; torch "
        f"{torch.__version__}, threads={torch.get_num_threads()}, numel={args.numel}, "
        f"dtype={args.dtype}, tensors={args.tensors}",
        file=sys.stderr,
    )

    t0 = time.perf_counter()
    opt = DeepSpeedCPUAdam(params, lr=args.lr, weight_decay=args.weight_decay, adamw_mode=True)
    print(
        f"[upstream_cpu_adam] optimizer constructed in {time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )

    with torch.no_grad():
        for _ in range(args.warmup):
            opt.step()
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)

    st = opt.state[params[0]]
    state_dtype = str(st["exp_avg"].dtype).replace("torch.", "") if "exp_avg" in st else None
    print(
        f"[upstream_cpu_adam] state dtype {state_dtype}; min {min(times):.4f} s, "
        f"median {sorted(times)[len(times) // 2]:.4f} s",
        file=sys.stderr,
    )

    json_out.write(
        json.dumps(
            {
                "peer": f"deepspeed=={deepspeed.__version__}",
                "times_s": times,
                "numel": args.numel,
                "dtype": args.dtype,
                "tensors": args.tensors,
                "threads": torch.get_num_threads(),
                "state_dtype": state_dtype,
                "torch": torch.__version__,
            }
        )
        + "\n"
    )
    json_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark worker: one rank of a 2-rank data-parallel training job on the tiny GPT of
examples/gpt.py, for bench/ddp_step.py. The same file serves every contender:

    --impl ours      deepspeed_ext via `deepspeed.initialize` (this project's `deepspeed`
                     face), ZeRO stage 0, config optimizer AdamW; started by our launcher:
                     deepspeed --num_gpus 2 bench/peers/ddp_step_worker.py --impl ours ...
    --impl ddp       torch DistributedDataParallel (gloo) + torch.optim.AdamW; started by
                     python -m torch.distributed.run --nproc_per_node 2 ...
    --impl upstream  UPSTREAM DeepSpeed (deepspeed==0.19.8, run with its venv's python and a
                     cwd outside the repository), same config as ours; started by the venv's
                     python -P -m torch.distributed.run --nproc_per_node 2 ...

--dtype bf16: ours and upstream get `bf16: {enabled: true}` (bf16 model, fp32 master
weights); ddp by default keeps fp32 params and runs forward + loss under
torch.autocast("cpu", dtype=torch.bfloat16) (torch's AMP recipe; grads and AdamW fp32), or
with --ddp-bf16 model trains a bf16 model (bf16 grads and AdamW states, no fp32 masters).

Each rank trains on random token batches made from a fixed seed per (rank, step), all
generated before the clock starts. Rank 0 times `--steps` optimizer steps after `--warmup`
untimed ones, between two barriers, and prints exactly one line on stdout starting with
RESULT_TAG followed by JSON (everything else a library prints is sent to stderr).
Imports only torch (plus the chosen deepspeed) and the standard library; examples/gpt.py is
loaded by file path so the repository never lands on sys.path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULT_TAG = "DDP_STEP_RESULT "
GPT_FILE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def _isolate_from_repo() -> None:
    """Upstream only: keep the project's own `deepspeed` package (repo root on cwd, script
    dir or PYTHONPATH) from shadowing upstream: keep only sys.path entries inside this
    interpreter's prefix (the venv) or its base prefix (the stdlib)."""
    roots = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}

    def inside(p: str) -> bool:
        rp = os.path.realpath(p or os.getcwd())
        return any(rp == r or rp.startswith(r + os.sep) for r in roots)

    sys.path[:] = [p for p in sys.path if inside(p)]


def use_upstream() -> None:
    """Upstream only, before torch is imported: isolated from the repository, on the CPU
    accelerator, its ops loaded from where setup_upstream.sh built them (elsewhere the first
    job would JIT-build them again)."""
    _isolate_from_repo()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR",
        os.environ.get("DS_UPSTREAM_TORCH_EXT") or os.path.join(sys.prefix, "torch_extensions"),
    )


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("ours", "ddp", "upstream"), required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ddp-adamw",
        choices=("default", "fused", "foreach", "loop"),
        default="default",
        help="ddp only: torch.optim.AdamW() as constructed by default, or fused/foreach/loop",
    )
    ap.add_argument(
        "--ddp-bf16",
        choices=("autocast", "model"),
        default="autocast",
        help="ddp --dtype bf16 only: fp32 params under bf16 autocast, or a bf16 model (pure "
        "bf16: bf16 params, grads and AdamW states, no fp32 master weights)",
    )
    ap.add_argument("--run-id", default="", help="a tag the driver finds leftover ranks by")
    ap.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launchers")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("need steps >= 1, warmup >= 0")
    return a


def _load_gpt():
    spec = importlib.util.spec_from_file_location("ddp_step_gpt", GPT_FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod.GPT, mod.GPTConfig


def ds_config(args: argparse.Namespace) -> dict:
    """The one config ours and upstream both get."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "weight_decay": args.weight_decay},
        },
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
    }


def token_batches(args: argparse.Namespace, rank: int) -> list[tuple[Any, Any]]:
    """Random token batches, a fixed seed per (rank, step), made before the clock starts
    (shared with zero_step_worker.py)."""
    import torch

    batches = []
    for s in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed((args.seed * 1000 + rank) * 1_000_003 + s)
        tok = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        batches.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return batches


def main() -> int:
    args = _parse()

    # stdout carries only the result line: libraries log and print to stdout, so point fd 1
    # at stderr for the whole run and keep a private handle on the real stdout.
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    if args.impl == "upstream":
        use_upstream()

    import torch
    import torch.distributed as dist

    GPT, GPTConfig = _load_gpt()
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
    )
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    threads_before = torch.get_num_threads()
    t_init = time.perf_counter()

    autocast = args.impl == "ddp" and args.dtype == "bf16" and args.ddp_bf16 == "autocast"
    if args.impl == "ddp" and args.dtype == "bf16" and not autocast:
        model = model.to(torch.bfloat16)
    info: dict = {}
    if args.impl in ("ours", "upstream"):
        import deepspeed

        ds_dir = os.path.realpath(os.path.dirname(deepspeed.__file__))
        if args.impl == "upstream" and not ds_dir.startswith(os.path.realpath(sys.prefix) + os.sep):
            print(
                f"error: imported deepspeed from {ds_dir}, not from {sys.prefix}", file=sys.stderr
            )
            return 2
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config(args))
        opt = engine.optimizer
        info["deepspeed"] = f"{deepspeed.__version__} from {ds_dir}"
        info["optimizer"] = type(opt).__name__
        inner = getattr(opt, "optimizer", None)  # a wrapper's base optimizer
        if inner is not None and inner is not opt:
            info["base_optimizer"] = type(inner).__name__
        info["param_dtype"] = str(next(engine.module.parameters()).dtype).removeprefix("torch.")

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

    else:
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        kw: dict[str, Any] = {
            "default": {},
            "fused": {"fused": True},
            "foreach": {"foreach": True},
            "loop": {"foreach": False},
        }[args.ddp_adamw]
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay, **kw)
        info["optimizer"] = f"torch.optim.AdamW({', '.join(f'{k}={v}' for k, v in kw.items())})"
        info["optimizer_flags"] = {k: opt.defaults.get(k) for k in ("fused", "foreach")}
        info["param_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        info["autocast"] = "bfloat16" if autocast else None

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = ddp(x, y)
            loss.backward()
            opt.step()
            return loss

    init_s = time.perf_counter() - t_init
    rank, world = dist.get_rank(), dist.get_world_size()

    batches = token_batches(args, rank)

    for x, y in batches[: args.warmup]:
        step(x, y)
    dist.barrier()
    t0 = time.perf_counter()
    marks = []
    loss = None
    for x, y in batches[args.warmup :]:
        loss = step(x, y)
        marks.append(time.perf_counter())
    dist.barrier()
    elapsed = time.perf_counter() - t0
    step_s = [b - a for a, b in zip([t0, *marks[:-1]], marks)]

    if args.impl == "ddp" and args.ddp_adamw == "default":
        # What AdamW's defaults resolved to: its step stores no verdict, so ask torch's rule.
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in opt.param_groups for p in g["params"]]
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False)
        info["optimizer_resolved"] = "fused" if fused else ("foreach" if foreach else "for-loop")

    if rank == 0:
        out = {
            "impl": args.impl,
            "dtype": args.dtype,
            "world_size": world,
            "steps": args.steps,
            "warmup": args.warmup,
            "elapsed_s": elapsed,
            "steps_per_s": args.steps / elapsed,
            "samples_per_s": args.steps * args.micro_batch * world / elapsed,
            "step_s": step_s,
            "init_s": init_s,
            "final_loss": float(loss.detach().float()) if loss is not None else None,
            "params": n_params,
            "threads": torch.get_num_threads(),
            "threads_before_init": threads_before,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__,
            **info,
        }
        json_out.write(RESULT_TAG + json.dumps(out) + "\n")
        json_out.flush()
    if args.impl == "ddp":
        del ddp, opt, step  # dropped before the group (destroy_group)
        destroy_group()
    return 0


def destroy_group() -> None:
    """destroy_process_group once the caller has dropped its torch DDP wrapper. The DDP
    Reducer holds the gloo group; freed after the destroy (at interpreter exit) its dealloc
    runs the group's destructor holding the GIL while a gloo thread waits for the GIL to free
    a finished work: a deadlock in the peer, seen in the suite (py-spy: ~Reducer ->
    ~ProcessGroupGloo -> thread::join). Collected while the group is registered, the
    Reducer only drops a reference, and the destroy below joins the threads."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

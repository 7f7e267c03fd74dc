"""Benchmark worker: one rank of a 2-rank ZeRO training job on a GPT of examples/gpt.py, for
bench/zero_step.py (stages 0-2) and bench/zero3_step.py (stage 3). Sibling of
ddp_step_worker.py (whose helpers it loads by file path):

    --impl ours      deepspeed_ext via `deepspeed.initialize`, config optimizer AdamW,
                     zero_optimization {stage: --stage[, offload_optimizer: {device: cpu}]
                     [, offload_param: {device: cpu}], ...--zero-json}; started by our
                     launcher (deepspeed --num_gpus 2 ...)
    --impl upstream  UPSTREAM DeepSpeed 0.19.8 with the same config (its venv's python, a cwd
                     outside the repository, DS_ACCELERATOR=cpu); its torch.distributed.run
    --impl zero_redundancy
                     torch DDP (gloo) + torch.distributed.optim.ZeroRedundancyOptimizer over
                     torch.optim.AdamW (torch's stage-1 peer); torch.distributed.run
    --impl fsdp2     torch FSDP2: fully_shard(each Block) then fully_shard(model) on a CPU
                     device mesh (gloo), torch.optim.AdamW (the stage-3 peer);
                     torch.distributed.run

fp32 throughout. Random token batches from a fixed seed per (rank, step), made before the
clock. Rank 0 times --steps optimizer steps after --warmup untimed ones, between barriers.
Memory, per rank, from /proc/self/status: VmRSS after the imports (baseline), VmHWM at the
end of setup + warmup (the peak so far, the model and optimizer built and stepped), then
`5 > /proc/self/clear_refs` resets VmHWM to the current RSS and VmHWM after the timed steps
is the steady-state peak; the job's peak is the larger of the two. Rank 0 gathers every
rank's figures and prints one line on stdout: RESULT_TAG + JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

RESULT_TAG = "ZERO_STEP_RESULT "
_spec = importlib.util.spec_from_file_location(
    "ddp_step_worker", Path(__file__).resolve().parent / "ddp_step_worker.py"
)
assert _spec is not None and _spec.loader is not None
ddw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ddw)  # stdlib-only at import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--impl", choices=("ours", "upstream", "zero_redundancy", "fsdp2"), required=True
    )
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=1)
    ap.add_argument("--offload", action="store_true", help="offload_optimizer device cpu")
    ap.add_argument("--offload-param", action="store_true", help="offload_param device cpu")
    ap.add_argument("--zero-json", default="{}", help="more zero_optimization keys (JSON object)")
    ap.add_argument(
        "--gradient-clipping",
        type=float,
        default=None,
        help="set gradient_clipping (default: unset)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=14)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--destroy",
        action="store_true",
        help="dist.destroy_process_group() at the end (ours, upstream)",
    )
    ap.add_argument("--run-id", default="", help="a tag the driver finds leftover ranks by")
    ap.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launchers")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("need steps >= 1, warmup >= 0")
    return a


def ds_config(args: argparse.Namespace) -> dict:
    """The one config ours and upstream both get."""
    zero: dict = {"stage": args.stage, **json.loads(args.zero_json)}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if args.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    clip = {} if args.gradient_clipping is None else {"gradient_clipping": args.gradient_clipping}
    return {
        **clip,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "weight_decay": args.weight_decay},
        },
        "wall_clock_breakdown": False,
    }


def proc_status_kb(*keys: str) -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0])
    return out


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _local(t):
    """This rank's part of a tensor: a DTensor's (FSDP2) local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_bytes(opt, model) -> dict:
    """Bytes of the innermost optimizer's state tensors (AdamW m, v) and of its params that
    are separate copies (fp32 master partitions), not views of the model's weights (nor, in
    stage 3, of their partitions `ds_tensor`); this rank's local shards of DTensors."""
    while getattr(opt, "optimizer", None) is not None or getattr(opt, "optim", None) is not None:
        opt = getattr(opt, "optimizer", None) or opt.optim
    import torch

    weights = [_local(p) for p in model.parameters()]
    weights += [p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor")]
    model_ptrs = {w.untyped_storage().data_ptr() for w in weights}
    state = sum(
        _local(t).numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    masters = sum(
        _local(p).numel() * p.element_size()
        for g in opt.param_groups
        for p in g["params"]
        if _local(p).untyped_storage().data_ptr() not in model_ptrs
    )
    return {"base_optimizer": type(opt).__name__, "state_bytes": state, "master_bytes": masters}


def main() -> int:
    args = _parse()
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")  # stdout carries only the result line
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.impl == "upstream":
        ddw.use_upstream()

    import torch
    import torch.distributed as dist

    info: dict = {}
    if args.impl in ("ours", "upstream"):
        import deepspeed

        ds_dir = os.path.realpath(os.path.dirname(deepspeed.__file__))
        if args.impl == "upstream" and not ds_dir.startswith(os.path.realpath(sys.prefix) + os.sep):
            print(f"error: imported deepspeed from {ds_dir}, not {sys.prefix}", file=sys.stderr)
            return 2
        info["deepspeed"] = f"{deepspeed.__version__} from {ds_dir}"
    rss_import = proc_status_kb("VmRSS")["VmRSS"]

    GPT, GPTConfig = ddw._load_gpt()
    cfg = GPTConfig(args.vocab, args.seq, args.n_layer, args.n_head, args.d_model)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    t_init = time.perf_counter()
    if args.impl == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dist.init_process_group("gloo")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(
            wrapped.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=args.lr,
            weight_decay=args.weight_decay,
        )
        info["optimizer"] = "ZeroRedundancyOptimizer"
    elif args.impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        info["optimizer"] = "AdamW (FSDP2 fully_shard)"
    if args.impl in ("zero_redundancy", "fsdp2"):

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = wrapped(x, y)
            loss.backward()
            opt.step()
            return loss

    else:
        engine, opt, _, _ = deepspeed.initialize(model=model, config=ds_config(args))
        model = engine.module
        info["optimizer"] = type(opt).__name__

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

    init_s = time.perf_counter() - t_init
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = ddw.token_batches(args, rank)

    for x, y in batches[: args.warmup]:
        step(x, y)
    setup = proc_status_kb("VmHWM", "VmRSS")
    reset_ok = reset_peak()
    dist.barrier()
    t0 = time.perf_counter()
    marks, loss = [], None
    for x, y in batches[args.warmup :]:
        loss = step(x, y)
        marks.append(time.perf_counter())
    dist.barrier()
    elapsed = time.perf_counter() - t0
    end = proc_status_kb("VmHWM", "VmRSS")
    mem = {
        "rank": rank,
        "rss_after_import_kb": rss_import,
        "rss_after_setup_kb": setup["VmRSS"],
        "hwm_setup_kb": setup["VmHWM"],
        "hwm_steady_kb": end["VmHWM"] if reset_ok else None,
        "hwm_job_kb": max(setup["VmHWM"], end["VmHWM"]),
        "peak_reset_ok": reset_ok,
        **optimizer_bytes(opt, model),
    }
    mems: list = [None] * world
    dist.all_gather_object(mems, mem)

    if rank == 0:
        out = {
            "impl": args.impl,
            "stage": args.stage,
            "offload": args.offload,
            "offload_param": args.offload_param,
            "zero_json": json.loads(args.zero_json),
            "world_size": world,
            "steps": args.steps,
            "warmup": args.warmup,
            "elapsed_s": elapsed,
            "steps_per_s": args.steps / elapsed,
            "step_s": [b - a for a, b in zip([t0, *marks[:-1]], marks)],
            "init_s": init_s,
            "final_loss": float(loss.detach()) if loss is not None else None,
            "params": n_params,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "mem": mems,
            **info,
        }
        json_out.write(RESULT_TAG + json.dumps(out) + "\n")
        json_out.flush()
    if args.impl in ("zero_redundancy", "fsdp2"):
        del wrapped, opt, step, model  # dropped before the group (ddw.destroy_group)
        ddw.destroy_group()
    elif args.destroy:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model and a training run shared by the ZeRO tests (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tests.unit.runtime.models import batch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 40)
        self.body = nn.Sequential(nn.GELU(), nn.Linear(40, 40), nn.GELU())
        self.head = nn.Linear(40, 4)
        self.unused = nn.Linear(3, 3)  # never in forward: its grad stays zero
        self.embed.bias.requires_grad_(False)  # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def train(
    stage: int,
    steps: int = 4,
    gas: int = 2,
    extra: dict[str, Any] | None = None,
    data_rank: int | None = None,
    mpu: Any = None,
    plain_backward: bool = False,
    zero_init: bool = False,
) -> dict:
    """data_rank picks the batches (default: the global rank); mpu is passed to initialize;
    plain_backward runs loss.backward() instead of engine.backward(loss); zero_init builds
    the model under zero.Init(mpu=mpu), partitioned over the mpu's data-parallel group."""
    from deepspeed_ext.runtime.initialize import initialize

    rank = int(os.environ["RANK"]) if data_rank is None else data_rank
    if zero_init:
        from deepspeed_ext.zero.stage3 import Init

        with Init(mpu=mpu):
            model = Net()
        shards = {n: p.ds_tensor.numel() for n, p in model.named_parameters()}
    else:
        model = Net()
        shards = {}
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.startswith("head")], "lr": 2e-2},
        {
            "params": [p for n, p in model.named_parameters() if not n.startswith("head")],
            "weight_decay": 0.1,
        },
    ]
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "steps_per_print": 1000,
        **(extra or {}),
    }
    engine, opt, _, _ = initialize(model=model, model_parameters=groups, config=cfg, mpu=mpu)
    losses = []
    for micro in range(steps * gas):
        x, y = batch(micro, rank, size=4)
        out = engine(x.to(next(engine.module.parameters()).dtype))
        loss = nn.functional.mse_loss(out.float(), y)
        if plain_backward:  # the end of backward comes from the autograd callback alone
            (loss / gas).backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    from deepspeed_ext.zero.stage3 import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # a no-op below stage 3
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    opt_swap = getattr(engine.strategy, "optimizer_swap", None)
    swaps = {id(p.ds_swap): p.ds_swap for p in model.parameters() if getattr(p, "ds_swap", None)}
    swapped = {
        "params": sum(getattr(p, "ds_swap", None) is not None for p in model.parameters()),
        "optimizer_bytes": opt_swap.swapper.nbytes_on_disk() if opt_swap else 0,
        "param_bytes": sum(sw.swapper.nbytes_on_disk() for sw in swaps.values()),
        "shared": sum(
            bool(getattr(p, "ds_swap", None) and p.ds_swap.shares(p)) for p in model.parameters()
        ),
        **{k: sum(sw.stats[k] for sw in swaps.values()) for k in ("read_ahead", "fetched_ahead")},
        **(opt_swap.stats if opt_swap else {}),
    }
    engine.destroy()
    return {
        "params": params,
        "losses": losses,
        "state_bytes": state_bytes,
        "grad_norm": engine.get_global_grad_norm(),
        "swapped": swapped,
        "shards": shards,
    }


def train_gpt(
    stage: int,
    steps: int = 3,
    zero: dict[str, Any] | None = None,
    leaf: bool = False,
    clip: float = 1.0,
) -> dict:
    """The example GPT (tied embeddings, nested blocks) under a ZeRO stage."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters
    from examples.gpt import GPT, GPTConfig

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32))
    if leaf:  # each Block gathered as a whole, its submodules hook-free
        from deepspeed_ext.zero.stage3 import set_z3_leaf_modules

        set_z3_leaf_modules(model, ["Block"])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 0,
            **(zero or {}),
        },
        "steps_per_print": 1000,
    }
    engine, _, _, _ = initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps * 2):
        idx = torch.randint(0, 32, (2, 17), generator=g)
        loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    hooks = getattr(engine.strategy, "hooks", None)
    stats = dict(hooks.coordinator.stats) if hooks is not None else {}
    if hooks is not None and hooks.tied is not None:
        stats["tied_uses"] = hooks.tied.uses
    opt_swap = getattr(engine.strategy, "optimizer_swap", None)
    stats.update(opt_swap.stats if opt_swap is not None else {})
    engine.destroy()
    return {"params": params, "losses": losses, "stats": stats}


def plain_and_engine_backward(stages: list[int]) -> dict[tuple[int, bool], dict]:
    """Every stage trained twice in one process group: with engine.backward(loss), and with
    a plain loss.backward() (whose end of backward comes from the autograd callback)."""
    return {(s, plain): train(s, plain_backward=plain) for s in stages for plain in (False, True)}


def train_with_comm_keys(stage: int, keys: dict[str, Any]) -> dict:
    """train() with zero_optimization communication keys set ([Note: ZeRO communication
    keys]), counting the collectives the keys ask for: bucket all-reduces in place of
    reduce-scatters, and the pieces of the parameters' all-gathers."""
    from deepspeed_ext import comm
    from tests.helpers.counting import count_calls

    counts = count_calls(comm, ["all_reduce_bucket", "all_gather"])
    extra = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 500, **keys}}
    out = train(stage, 4, 2, extra)
    return {**out, "counts": counts}


def train_in_comm_dtype(stage: int, dtype: str | None) -> dict:
    """train() with communication_data_type ([Note: communication dtype]), adding up the
    gradient elements each rank puts on the wire per dtype: all-reduced (stage 0's buckets)
    or sent to their owners (ZeRO's reduce-scatter on gloo: [Note: reduce-scatter by
    exchange])."""
    import collections

    import torch.distributed as td

    reduced: collections.Counter[str] = collections.Counter()
    real_all_reduce, real_isend = td.all_reduce, td.isend

    def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced[str(t.dtype).removeprefix("torch.")] += t.numel()
        return real_all_reduce(t, *args, **kwargs)

    def isend(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced[str(t.dtype).removeprefix("torch.")] += t.numel()
        return real_isend(t, *args, **kwargs)

    td.all_reduce, td.isend = all_reduce, isend
    extra: dict[str, Any] = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        # plain SGD: each update is the reduced gradient itself (Adam would amplify the
        # rounding of tiny gradients into full-size steps)
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if dtype is not None:
        extra["communication_data_type"] = dtype
    out = train(stage, 4, 2, extra)
    return {**out, "reduced": dict(reduced)}

"""Runs behind test_moe_engine.py (importable by spawned ranks): a small MoE model trained by
the engine with its experts spread over ranks, against the same model trained in one
process with every expert local ([Note: expert groups])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

H = 8
EXPERTS = 4
MICRO = 6  # tokens per micro-batch and rank
STEPS = 3
GAS = 2
LR = 1e-2
CLIP = 0.05  # small: clipping acts on every step, so a wrong norm shows


class Net(nn.Module):
    def __init__(self, ep_size: int, k: int) -> None:
        super().__init__()
        from deepspeed_ext.moe import MoE

        self.inp = nn.Linear(H, H)
        expert = nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))
        self.moe = MoE(
            H,
            expert,
            num_experts=EXPERTS,
            ep_size=ep_size,
            k=k,
            capacity_factor=1.0,
            min_capacity=1,
            drop_tokens=True,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.out = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return nn.functional.mse_loss(self.out(h), y) + 0.01 * l_aux


def whole(k: int) -> Net:
    """Every expert local, each with weights of its own (they start as copies)."""
    torch.manual_seed(0)
    net = Net(1, k)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return net


def local_experts(state: dict[str, torch.Tensor], ep_rank: int, local: int) -> dict[str, Any]:
    """The whole model's state as one expert-parallel rank holds it."""
    pre = "moe.deepspeed_moe.experts.deepspeed_experts."
    out = {n: t for n, t in state.items() if not n.startswith(pre)}
    for n, t in state.items():
        if n.startswith(pre):
            idx, rest = n[len(pre) :].split(".", 1)
            j = int(idx) - ep_rank * local
            if 0 <= j < local:
                out[f"{pre}{j}.{rest}"] = t
    return out


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, H, generator=g), torch.randn(MICRO, 1, generator=g)


def reference(world: int, k: int, steps: int = STEPS) -> dict[str, Any]:
    """One process: each rank's micro-batch routed on its own (gating is per rank), the loss
    the mean over ranks and micro-steps, torch's clipping and Adam."""
    net = whole(k)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(GAS):
            for r in range(world):
                loss = net(*batch(step, micro, r)) / (GAS * world)
                loss.backward()
                total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        losses.append(total)
    return {"state": {n: t.detach().clone() for n, t in net.state_dict().items()}, "losses": losses}


def train(
    ep_size: int, k: int, spoil_copies: bool, zero: dict[str, Any] | None = None
) -> dict[str, Any]:
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    local = EXPERTS // ep_size
    ep_rank = rank % ep_size
    net = Net(ep_size, k)
    net.load_state_dict(local_experts(whole(k).state_dict(), ep_rank, local))
    if spoil_copies and rank >= ep_size:  # not the first copy: the engine must broadcast
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        # small buckets: several per group, so the order of their reductions counts
        "zero_optimization": {"reduce_bucket_size": 100, **(zero or {})},
    }
    engine, *_ = deepspeed.initialize(model=net, config=config)
    losses = []
    for step in range(STEPS):
        total = torch.zeros((), device=comm.collective_device(None))
        for micro in range(GAS):
            loss = engine(*batch(step, micro, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach().to(total.device) / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    state = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    return {"state": state, "losses": losses, "ep_rank": ep_rank, "local": local}


def refused(stage: int) -> str:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
    }
    try:
        deepspeed.initialize(model=Net(2, 1), config=config)
    except ValueError as e:
        return str(e)
    return "accepted"


def accessors_after_another_engine() -> dict[str, Any]:
    """Upstream's accessors still answer for an engine's groups after another initialize;
    a gate given upstream's torch process group agrees its capacity over it; the groups'
    order cannot change under a layout; what keeps gradients on each rank is refused."""
    import deepspeed
    from deepspeed.moe.sharded_moe import top1gating
    from deepspeed.utils import groups
    from deepspeed_ext import comm
    from deepspeed_ext.comm.expert_groups import ensure_expert_groups
    from deepspeed_ext.runtime.onebit import OnebitAdam

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    first, *_ = deepspeed.initialize(model=Net(2, 1), config=config)
    out: dict[str, Any] = {}
    try:
        first.enable_backward_allreduce = False
    except ValueError as e:
        out["local"] = str(e)
    try:
        ensure_expert_groups(2, data_before_expert=True)
    except ValueError as e:
        out["order"] = str(e)
    net = Net(2, 1)
    try:
        plain = {"train_micro_batch_size_per_gpu": MICRO}
        deepspeed.initialize(model=net, optimizer=OnebitAdam(net.parameters()), config=plain)
    except ValueError as e:
        out["onebit"] = str(e)
    onebit = {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 2}}
    try:  # the same optimizer from the config
        deepspeed.initialize(model=Net(2, 1), config={**plain, "optimizer": onebit})
    except ValueError as e:
        out["onebit_config"] = str(e)
    deepspeed.initialize(model=nn.Linear(2, 2), config=config)
    out["size"] = groups._get_expert_parallel_world_size("ep_size_2")
    pg = groups._get_expert_parallel_group("ep_size_2")
    logits = torch.zeros(4 + 2 * comm.get_rank(), 2)
    logits[:, 0] = 1.0  # every token on expert 0: 4 tokens on rank 0, 6 on rank 1
    _, combine, _, _ = top1gating(logits, 1.0, 1, drop_tokens=False, ep_group=pg)
    out["capacity"] = combine.shape[-1]
    return out


def _config(precision: str, stage: int = 0) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
    }


def _engine(ep_size: int, k: int, precision: str, stage: int = 0) -> Any:
    import deepspeed
    from deepspeed_ext import comm

    net = Net(ep_size, k)
    local = EXPERTS // ep_size
    net.load_state_dict(local_experts(whole(k).state_dict(), comm.get_rank() % ep_size, local))
    engine, *_ = deepspeed.initialize(model=net, config=_config(precision, stage))
    return engine


def _steps(engine: Any, steps: range) -> None:
    from deepspeed_ext import comm

    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        for micro in range(GAS):
            x, y = batch(step, micro, comm.get_rank())
            engine.backward(engine(x.to(dtype), y.to(dtype)))
            engine.step()


def _global_state(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's state dict, experts under their global names, in fp32."""
    from deepspeed_ext.runtime.checkpoint import experts

    names = experts.global_names(engine.module)
    return {
        names.get(n, n): t.detach().float().clone() for n, t in engine.module.state_dict().items()
    }


def _global_masters(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 masters of this rank's trainable params, experts named globally (gathered
    from their partitions under ZeRO: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed_ext.runtime.checkpoint import experts

    names = experts.global_names(engine.module)
    return {
        names.get(n, n): safe_get_full_fp32_param(p).float()
        for n, p in engine.module.named_parameters()
    }


def resume(
    ep_save: int,
    ep_load: int,
    k: int,
    precision: str,
    where: str,
    stage_save: int = 0,
    stage_load: int = 0,
) -> dict[str, Any]:
    """Train 2 steps at ep_save, save, train a third; then a new engine at ep_load loads the
    checkpoint and trains the third step. Also what zero_to_fp32 and save_16bit_model give."""
    from deepspeed_ext import comm
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    comm.init_distributed()
    a = _engine(ep_save, k, precision, stage_save)
    _steps(a, range(2))
    a.save_checkpoint(where, tag="t")
    at_save = _global_state(a)
    masters = _global_masters(a)
    a.save_16bit_model(where, "model16.pt")
    _steps(a, range(2, 3))
    b = _engine(ep_load, k, precision, stage_load)
    b.load_checkpoint(where, tag="t")
    loaded = _global_state(b)
    _steps(b, range(2, 3))
    out: dict[str, Any] = {
        "uninterrupted": _global_state(a),
        "at_save": at_save,
        "masters": masters,
        "loaded": loaded,
        "resumed": _global_state(b),
    }
    if comm.get_rank() == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(where, tag="t")
        out["fp32"] = {n: t.float() for n, t in fp32.items()}
        out["16bit"] = {n: t.float() for n, t in torch.load(f"{where}/model16.pt").items()}
    comm.barrier()
    return out


def frozen_export(where: str) -> dict[str, Any]:
    """Global expert 3 (rank 1's second) frozen: left out of the 16-bit export and of
    zero_to_fp32 when frozen parameters are excluded."""
    from deepspeed_ext import comm
    from deepspeed_ext.runtime.checkpoint.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    comm.init_distributed()
    net = Net(2, 1)
    if comm.get_rank() == 1:
        for p in net.moe.deepspeed_moe.experts.deepspeed_experts[1].parameters():
            p.requires_grad_(False)
    engine = _engine_of(net)
    _steps(engine, range(1))
    engine.save_checkpoint(where, tag="t", exclude_frozen_parameters=True)
    engine.save_16bit_model(where, "w16.pt", exclude_frozen_parameters=True)
    out: dict[str, Any] = {}
    if comm.get_rank() == 0:
        out["16bit"] = sorted(torch.load(f"{where}/w16.pt"))
        out["fp32"] = sorted(
            get_fp32_state_dict_from_zero_checkpoint(where, tag="t", exclude_frozen_parameters=True)
        )
    comm.barrier()
    return out


def _engine_of(net: nn.Module) -> Any:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=net, config=_config("fp32"))
    return engine


def _two_groups(net: nn.Module) -> list[dict[str, Any]]:
    """Weights and the rest, as a weight-decay split makes them."""
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if not n.endswith("weight")]},
    ]


def _partly_frozen(rank: int) -> Any:
    """ZeRO 2 at ep_size 2 with two param groups; ep rank 0's experts are frozen, so those
    ranks have no expert groups at all."""
    import deepspeed

    net = Net(2, 2)
    net.load_state_dict(local_experts(whole(2).state_dict(), rank % 2, EXPERTS // 2))
    if rank % 2 == 0:
        net.moe.deepspeed_moe.experts.requires_grad_(False)
    config = _config("fp32", stage=2)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=_two_groups(net), config=config)
    return engine


def resume_partly_frozen(where: str) -> dict[str, Any]:
    from deepspeed_ext import comm

    comm.init_distributed()
    rank = comm.get_rank()
    a = _partly_frozen(rank)
    _steps(a, range(2))
    a.save_checkpoint(where, tag="t")
    _steps(a, range(2, 3))
    b = _partly_frozen(rank)
    b.load_checkpoint(where, tag="t")
    _steps(b, range(2, 3))
    return {"uninterrupted": _global_state(a), "resumed": _global_state(b)}


def reference_partly_frozen() -> dict[str, torch.Tensor]:
    """One process: global experts 0 and 1 (ep rank 0's) frozen."""
    net = whole(2)
    for j in (0, 1):
        net.moe.deepspeed_moe.experts.deepspeed_experts[j].requires_grad_(False)
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(GAS):
            for r in range(4):
                (net(*batch(step, micro, r)) / (GAS * 4)).backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        opt.step()
    return {n: t.detach().clone() for n, t in net.state_dict().items()}


def _by_local_index(net: Net) -> list[dict[str, Any]]:
    """Two groups of other options, each holding dense params and experts by their local
    index (so an expert changes group when the ep_size changes)."""
    first = [
        *net.inp.parameters(),
        *net.moe.deepspeed_moe.experts.deepspeed_experts[0].parameters(),
    ]
    ids = {id(p) for p in first}
    rest = [p for p in net.parameters() if id(p) not in ids]
    return [{"params": first, "lr": 2e-2}, {"params": rest, "lr": 1e-2, "betas": (0.8, 0.99)}]


def regrouped_options(where: str) -> list[tuple[float, tuple[float, ...]]]:
    """Saved at ZeRO 2 ep_size 2, loaded at ep_size 4: each optimizer group's options."""
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    rank = comm.get_rank()
    config = _config("fp32", stage=2)
    engines = []
    for ep in (2, 4):
        net = Net(ep, 2)
        net.load_state_dict(local_experts(whole(2).state_dict(), rank % ep, EXPERTS // ep))
        opt = torch.optim.Adam(_by_local_index(net))
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
        engines.append(engine)
    _steps(engines[0], range(1))
    engines[0].save_checkpoint(where, tag="t")
    engines[1].load_checkpoint(where, tag="t")
    return [(g["lr"], tuple(g["betas"])) for g in engines[1].optimizer.param_groups]


def mismatched_freeze() -> str:
    """ep_size 2 on 4 ranks; rank 1 freezes its second expert, whose copy on rank 3 trains."""
    import deepspeed
    from deepspeed_ext import comm

    comm.init_distributed()
    net = Net(2, 1)
    if comm.get_rank() == 1:
        net.moe.deepspeed_moe.experts.deepspeed_experts[1].requires_grad_(False)
    try:
        deepspeed.initialize(model=net, config=_config("fp32", stage=2))
    except ValueError as e:
        return str(e)
    return "accepted"

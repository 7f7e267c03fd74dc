"""Runs for the zero.Init / GatheredParameters tests (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch

from examples.gpt import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32)
CFG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1000,
}


def _z3(threshold: int = 0) -> dict[str, Any]:
    zero = {"stage": 3, "stage3_param_persistence_threshold": threshold}
    return {**CFG, "zero_optimization": zero}


def _train(engine: Any, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(100 + int(os.environ["RANK"]))
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 32, (2, 17), generator=g)
        loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from deepspeed_ext.zero.stage3 import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def build_under_init(d_model: int = 32, n_layer: int = 2) -> dict:
    """Per-rank parameter bytes of a model built under zero.Init, and its gathered weights."""
    from deepspeed_ext.comm import init_distributed
    from deepspeed_ext.zero.stage3 import Init

    init_distributed(verbose=False)
    torch.manual_seed(int(os.environ["RANK"]))  # ranks draw differently: Init must unify
    cfg = GPTConfig(vocab_size=32, seq_len=16, n_layer=n_layer, n_head=2, d_model=d_model)
    with Init(config_dict_or_path=_z3()):
        model = GPT(cfg)
    local = sum(p.ds_tensor.numel() + p.data.numel() for p in model.parameters())
    full = sum(p.ds_numel for p in model.parameters())
    return {"local": local, "full": full, "weights": full_state(model)}


def train_init_stage3() -> dict:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import Init

    torch.manual_seed(0)
    with Init(config_dict_or_path=_z3()):
        model = GPT(SMALL)
    start = full_state(model)
    engine, _, _, _ = initialize(model=model, config=_z3())
    losses = _train(engine)
    return {"start": start, "losses": losses, "params": full_state(engine.module)}


def train_plain_stage0(start: dict[str, torch.Tensor]) -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    model = GPT(SMALL)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    engine, _, _, _ = initialize(model=model, config=CFG)
    losses = _train(engine)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def modify_and_scatter() -> dict:
    """Rank 1 writes new values inside GatheredParameters(modifier_rank=1); after the block
    every rank's shard holds them, and a training step starts from them."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters

    torch.manual_seed(0)
    model = GPT(SMALL)
    # bf16: the fp32 master is a separate tensor (in fp32 it is the shard itself)
    engine, _, _, _ = initialize(model=model, config={**_z3(), "bf16": {"enabled": True}})
    w = engine.module.blocks[0].qkv.weight
    rank = int(os.environ["RANK"])
    with GatheredParameters([w], modifier_rank=1):
        if rank == 1:
            w.data.fill_(0.5)
    after = full_state(engine.module)["blocks.0.qkv.weight"].float()
    opt_master = engine.strategy.master_of(w).clone()
    return {"after": after, "master": opt_master, "shard": w.ds_tensor.float(), "empty": w.numel()}


def extra_forward_on_rank0() -> dict:
    """Rank 0 runs an evaluation forward the others do not: a rank-divergence bug."""
    import time

    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3.coordinator import RankDivergenceError

    torch.manual_seed(0)
    engine, _, _, _ = initialize(model=GPT(SMALL), config=_z3())
    rank = int(os.environ["RANK"])
    idx = torch.randint(0, 32, (2, 17))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    start = time.monotonic()
    try:
        for _ in range(2):
            loss = engine(x, y)
            if rank == 0:
                with torch.no_grad():
                    engine(x, y)
            engine.backward(loss)
            engine.step()
    except RankDivergenceError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def strict_access() -> dict:
    """DS_ZERO3_STRICT=1: training works; reading a released parameter raises, naming it."""
    os.environ["DS_ZERO3_STRICT"] = "1"
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters
    from deepspeed_ext.zero.stage3.strict import PartitionedParameterAccessError

    torch.manual_seed(0)
    engine, _, _, _ = initialize(model=GPT(SMALL), config=_z3())
    losses = _train(engine, 2)
    w = engine.module.blocks[0].qkv.weight
    try:
        float(w.sum())
        error = None
    except PartitionedParameterAccessError as exc:
        error = str(exc)
    with GatheredParameters([w]):
        inside = float(w.float().abs().sum())
    return {"losses": losses, "error": error, "inside": inside}


def save_16bit(save_dir: str) -> dict:
    """Stage 3, bf16: save_16bit_model writes the full weights (rank 0)."""
    from deepspeed_ext.runtime.initialize import initialize

    torch.manual_seed(0)
    cfg = {**_z3(), "bf16": {"enabled": True}}
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _, _, _ = initialize(model=GPT(SMALL), config=cfg)
    _train(engine, 1)
    ok = engine.save_16bit_model(save_dir)
    sd = engine._zero3_consolidated_16bit_state_dict()
    live = full_state(engine.module)
    numel = sum(p.ds_numel for p in engine.module.parameters())
    return {"ok": ok, "sd": sd, "live": live, "numel": numel}


def bad_nvme_path(path: str, section: str, fake_free: int | None) -> str:
    """initialize with an NVMe offload section whose path is unusable: the error text."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.offload import nvme

    if fake_free is not None:  # a nearly full disk
        real = os.statvfs

        class Full:
            def __init__(self, st: Any) -> None:
                self.f_bavail, self.f_frsize = fake_free, 1

        nvme.os.statvfs = lambda p: Full(real(p))  # type: ignore[attr-defined]
    zero = _z3()["zero_optimization"]
    zero[section] = {"device": "nvme", "nvme_path": path}
    try:
        initialize(model=GPT(SMALL), config={**CFG, "zero_optimization": zero})
    except ValueError as exc:
        return str(exc)
    return "no error"


def save_16bit_refused(save_dir: str) -> str:
    """Stage 3 without stage3_gather_16bit_weights_on_model_save: an error, and no file."""
    from deepspeed_ext.runtime.initialize import initialize

    engine, _, _, _ = initialize(model=GPT(SMALL), config=_z3())
    try:
        engine.save_16bit_model(save_dir)
    except ValueError as exc:
        return str(exc)
    return "no error"


def rank1_skips_a_block() -> dict:
    """DS_ZERO3_ORDER_CHECK=all: rank 1's forward skips a block (a data-dependent branch)."""
    os.environ["DS_ZERO3_ORDER_CHECK"] = "all"
    import types

    import torch.nn.functional as F

    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3.coordinator import RankDivergenceError

    torch.manual_seed(0)
    model = GPT(SMALL)

    def skipping_forward(self: Any, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        x = self.blocks[0](x)  # blocks[1] skipped
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    if int(os.environ["RANK"]) == 1:
        model.forward = types.MethodType(skipping_forward, model)  # type: ignore[method-assign]
    engine, _, _, _ = initialize(model=model, config=_z3())
    idx = torch.randint(0, 32, (2, 17))
    try:
        loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        engine.backward(loss)
    except RankDivergenceError as exc:
        return {"error": str(exc)}
    return {"error": None}


def edit_after_init() -> dict:
    """A small (kept whole) parameter of a zero.Init-built model edited in place after its
    module was built, outside GatheredParameters (a model's post-construction init): the
    masters start from the edited value, so a step at lr 0 leaves it."""
    from torch import nn

    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import Init

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg):
        small = nn.Linear(16, 16)
        model = nn.Sequential(small, nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        small.weight.fill_(0.5)
    engine, *_ = initialize(model=model, config=cfg)
    loss = engine(torch.randn(2, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return {
        "persist": bool(small.weight.ds_persist),
        "after": full_state(engine.module)["0.weight"],
    }


def init_edge_cases() -> dict[str, Any]:
    """zero.Init and GatheredParameters at their edges (found by a fuzzing helper against
    upstream 0.19.8): see the test for what each used to do."""
    import deepspeed_ext.comm as comm
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.zero.stage3 import GatheredParameters, Init
    from deepspeed_ext.zero.stage3.param import is_zero_param

    out: dict[str, Any] = {}
    rank = int(os.environ["RANK"])
    # 1. Init without a config; the engine's threshold of 0 decides persistence
    with Init():
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    model[0].bias.data.fill_(3.0)  # a post-construction init outside GatheredParameters
    engine, *_ = initialize(model=model, config=_z3(threshold=0))
    out["persisting"] = [n for n, p in engine.module.named_parameters() if p.ds_persist]
    with GatheredParameters([engine.module[0].bias]):
        out["edit_kept"] = bool((engine.module[0].bias == 3.0).all())
    # 2. an edit by the modifier rank in a block that raised: every rank ends with it
    with Init(config_dict_or_path=_z3(threshold=1000)):
        small = torch.nn.Linear(4, 3)
    engine, *_ = initialize(model=small, config=_z3(threshold=1000))
    bias = engine.module.bias
    try:
        with GatheredParameters(bias, modifier_rank=0):
            if rank == 0:
                bias.data.fill_(5.0)
            raise KeyError("a failed load")
    except KeyError:
        pass
    with GatheredParameters(bias):
        mine = bias.data.clone()
    both = [torch.zeros_like(mine) for _ in range(2)]
    comm.all_gather(both, mine)
    out["bias"] = [b.tolist() for b in both]
    # 3. a class defined inside an inner Init, built after it closed, in the outer one
    with Init():
        with Init():

            class Late(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.w = torch.nn.Parameter(torch.ones(7, 13))

        late = Late()
    out["late_partitioned"] = is_zero_param(late.w)
    # 4. skip_init inside Init: no values yet; partitioned at initialize
    with Init():
        skipped = torch.nn.utils.skip_init(torch.nn.Linear, 7, 13)
    engine, *_ = initialize(model=skipped, config=_z3())
    out["skip_init"] = (is_zero_param(skipped.weight), tuple(skipped.weight.ds_shape))
    return out


class _GathersInForward(torch.nn.Module):
    """Uses a layer's weight it gathers itself (as code written for upstream does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.other = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, backward_inside: bool) -> Any:
        from deepspeed_ext.zero.stage3 import GatheredParameters

        h = self.inp(x)
        with GatheredParameters(list(self.other.parameters())):
            out = torch.nn.functional.linear(h, self.other.weight, self.other.bias).sum()
            if backward_inside:
                out.backward()
        return out


def gathered_in_forward() -> dict[str, str]:
    """Its backward after the block: named, with the fix; inside the block: it runs."""
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(model=_GathersInForward(), config=_z3())
    out: dict[str, str] = {}
    for inside in (True, False):
        try:
            loss = engine(torch.randn(2, 8), inside)
            if not inside:
                engine.backward(loss)
            out[str(inside)] = "ran"
        except RuntimeError as e:
            out[str(inside)] = str(e)
    return out

"""Rank bodies for test_onebit_adam.py."""

from __future__ import annotations

from typing import Any

import torch

from tests.unit.runtime.models import batch, loss_fn, mlp


def _engine(optimizer: dict[str, Any], **extra: Any) -> Any:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(
        model=mlp(),
        config={"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer, **extra},
    )
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = batch(s, engine.dp_rank)
        loss = loss_fn(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


ADAM = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}


def onebit(freeze: int) -> dict[str, Any]:
    return {
        "type": "OneBitAdam",
        "params": {"lr": 1e-2, "weight_decay": 0.01, "freeze_step": freeze},
    }


def warmup_then_compression() -> dict[str, Any]:
    from deepspeed_ext import comm

    adam = _engine(ADAM)
    _train(adam, range(5))
    warm = _engine(onebit(freeze=100))
    _train(warm, range(5))
    # compression from step 4 on: the gradient all-reduce stops, the momentum is exchanged
    bit = _engine(onebit(freeze=3))
    _train(bit, range(3))
    allreduce_during_warmup = not bit.enable_backward_allreduce
    comm.configure(enabled=True)
    _train(bit, range(3, 8))
    names = {k: sorted(v) for k, v in comm.comms_logger.summary_rows().items()}
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    return {
        "adam": _params(adam),
        "warm": _params(warm),
        "bit": _params(bit),
        "switched_at_freeze": allreduce_during_warmup,
        "names": names,
    }


def resume(ckpt: str) -> dict[str, Any]:
    straight = _engine(onebit(freeze=3), gradient_clipping=1.0)
    _train(straight, range(4))
    straight.save_checkpoint(ckpt, tag="s4")
    _train(straight, range(4, 8))
    resumed = _engine(onebit(freeze=3), gradient_clipping=1.0)
    resumed.load_checkpoint(ckpt, tag="s4")
    after_load = resumed.enable_backward_allreduce
    _train(resumed, range(4, 8))
    return {"straight": _params(straight), "resumed": _params(resumed), "after_load": after_load}


def tiny_gpt_losses(steps: int, optimizers: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Each optimizer's losses on the same tiny GPT run (the same data on each rank)."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    sys.path.insert(0, str(root / "examples"))
    from corpus import CharData, generate
    from gpt import GPT, GPTConfig

    from deepspeed_ext.runtime.initialize import initialize

    data = CharData(generate(60_000, seed=0), 32)
    out = {}
    for name, opt in optimizers.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=32, n_layer=2, d_model=64))
        engine, *_ = initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 8, "optimizer": opt}
        )
        gen = torch.Generator().manual_seed(100 + engine.dp_rank)
        losses = []
        for _ in range(steps):
            loss = engine(*data.batch(8, gen))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[name] = losses
        engine.destroy()
    return out


def client_optimizer_under_zero1() -> str:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.onebit.adam import OnebitAdam

    model = mlp()
    try:
        initialize(
            model=model,
            optimizer=OnebitAdam(model.parameters()),
            config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}},
        )
    except ValueError as e:
        return str(e)
    return "accepted"


COMPRESSED = {"gradient_compression": {"algorithm": "1bit"}}
_TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))


def _learn(engine: Any, steps: range) -> list[float]:
    """A learnable task: y = tanh(x W) for a fixed W; each rank its own samples."""
    losses = []
    for s in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * s + engine.dp_rank))
        loss = torch.nn.functional.mse_loss(engine(x), torch.tanh(x @ _TEACHER))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


SGD = {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.0}}


def compressed_gradients(ckpt: str) -> dict[str, Any]:
    from deepspeed_ext import comm

    plain = _engine(SGD)
    plain_losses = _learn(plain, range(80))
    packed = _engine(
        SGD,
        **COMPRESSED,
        steps_per_print=40,
        jsonl_monitor={"enabled": True, "output_path": ckpt, "job_name": "m"},
    )
    comm.configure(enabled=True)
    packed_losses = _learn(packed, range(80))
    rows = {k: sorted(v) for k, v in comm.comms_logger.summary_rows().items()}
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    # resume: the error buffers come back from this rank's file
    straight = _engine(SGD, **COMPRESSED)
    _learn(straight, range(3))
    straight.save_checkpoint(ckpt, tag="c3")
    _learn(straight, range(3, 6))
    resumed = _engine(SGD, **COMPRESSED)
    resumed.load_checkpoint(ckpt, tag="c3")
    _learn(resumed, range(3, 6))
    import json
    from pathlib import Path

    metrics_file = Path(ckpt) / "m" / "metrics.jsonl"
    metrics = (
        [json.loads(x) for x in metrics_file.read_text().splitlines()]
        if metrics_file.exists()
        else []
    )
    return {
        "metrics": metrics,
        "plain": plain_losses,
        "packed": packed_losses,
        "packed_params": _params(packed),
        "rows": rows,
        "straight": _params(straight),
        "resumed": _params(resumed),
    }


def pipeline_onebit() -> dict[str, Any]:
    """2 stages x 2 data-parallel ranks, 1-bit Adam compressing from step 3."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule
    from tests.unit.runtime.pipe.pipe_runs import MICRO, batches, lm_loss, specs

    module = PipelineModule(
        specs(True), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform"
    )
    engine, *_ = initialize(
        model=module,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}},
        },
    )
    dp = engine.grid.get_data_parallel_id()
    losses = []
    for step in range(5):
        it = iter(batches(step, dp, 2)) if engine._needs_data() else None
        losses.append(float(engine.train_batch(it)))
    return {
        "stage": engine.stage_id,
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "allreduce": engine.enable_backward_allreduce,
    }


ZERO_CASES = [
    ({"algorithm": "2bit"}, 1),
    ({"algorithm": "topk", "topk_ratio": 0.3, "huffman_coding": True}, 2),
    ({"algorithm": "1bit"}, 2),
]


def compressed_gradients_under_zero(ckpt: str) -> dict[str, Any]:
    """Each case against fp32 gradients at the same stage, and a resume of the last."""
    from deepspeed_ext import comm

    out: dict[str, Any] = {}
    for section, stage in ZERO_CASES:
        zero = {"zero_optimization": {"stage": stage}}
        plain = _learn(_engine(SGD, **zero), range(60))
        engine = _engine(SGD, gradient_compression=section, **zero)
        comm.configure(enabled=True)
        packed = _learn(engine, range(60))
        rows = {k: sorted(v) for k, v in comm.comms_logger.summary_rows().items()}
        comm.configure(enabled=False)
        comm.comms_logger.reset_data()
        out[f"{section['algorithm']}-{stage}"] = {
            "plain": plain,
            "packed": packed,
            "rows": rows,
            "params": _params(engine),
        }
    straight = _engine(SGD, gradient_compression=section, **zero)
    _learn(straight, range(3))
    straight.save_checkpoint(ckpt, tag="z3")
    _learn(straight, range(3, 6))
    resumed = _engine(SGD, gradient_compression=section, **zero)
    resumed.load_checkpoint(ckpt, tag="z3")
    _learn(resumed, range(3, 6))
    out["straight"], out["resumed"] = _params(straight), _params(resumed)
    return out


def zero_one(freeze: int, scaler: int, **extra: Any) -> dict[str, Any]:
    params = {"lr": 1e-2, "weight_decay": 0.01, "var_freeze_step": freeze}
    params.update(var_update_scaler=scaler, local_step_scaler=2, local_step_clipper=4)
    params.update(extra)
    return {"type": "ZeroOneAdam", "params": params}


def zero_one_schedule() -> dict[str, Any]:
    """Warm-up against Adam; then the schedule of full all-reduces and of synchronisations."""
    from deepspeed_ext import comm

    adam, warm = _engine(ADAM), _engine(zero_one(freeze=100, scaler=100))
    _train(adam, range(6))
    _train(warm, range(6))
    engine = _engine(zero_one(freeze=8, scaler=2))
    allreduce, same, rows = [], [], []
    for s in range(16):
        allreduce.append(engine.enable_backward_allreduce)
        comm.configure(enabled=True)
        _train(engine, range(s, s + 1))
        rows.append(sorted(comm.comms_logger.summary_rows()))
        comm.configure(enabled=False)
        comm.comms_logger.reset_data()
        mine = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(engine.dp_world_size)]
        torch.distributed.all_gather(everyone, mine)
        same.append(all(torch.equal(everyone[0], o) for o in everyone[1:]))
    return {
        "adam": _params(adam),
        "warm": _params(warm),
        "allreduce": allreduce,
        "same": same,
        "rows": rows,
        "lr_zero": _zero_one_at_lr_zero(),
    }


def _zero_one_at_lr_zero() -> dict[str, Any]:
    """A schedule that decays the lr to 0 in the local phase: a synchronisation with no lr
    since the last has no movement to recover the momentum from (it divided by 0)."""
    decay = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1}
    engine = _engine(
        zero_one(freeze=2, scaler=2),
        scheduler={"type": "WarmupDecayLR", "params": {**decay, "total_num_steps": 6}},
    )
    _train(engine, range(6))
    losses = _train(engine, range(6, 14))
    mine = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(engine.dp_world_size)]
    torch.distributed.all_gather(everyone, mine)
    return {
        "same": all(torch.equal(everyone[0], o) for o in everyone[1:]),
        "losses": losses,
    }


def zero_one_resume(ckpt: str) -> dict[str, Any]:
    """Saved between two synchronisations of the local phase (the ranks' params differ)."""
    straight = _engine(zero_one(freeze=4, scaler=2))
    _train(straight, range(11))
    straight.save_checkpoint(ckpt, tag="z11")
    _train(straight, range(11, 16))
    resumed = _engine(zero_one(freeze=4, scaler=2))
    resumed.load_checkpoint(ckpt, tag="z11")
    _train(resumed, range(11, 16))
    return {"straight": _params(straight), "resumed": _params(resumed)}


LAMB = {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def onebit_lamb(freeze: int) -> dict[str, Any]:
    return {
        "type": "OneBitLamb",
        "params": {"lr": 1e-2, "weight_decay": 0.01, "freeze_step": freeze},
    }


def onebit_lamb_runs(ckpt: str) -> dict[str, Any]:
    """Warm-up against LAMB, the switch, one model on every rank, and a resume."""
    from deepspeed_ext import comm

    lamb, warm = _engine(LAMB), _engine(onebit_lamb(100))
    _train(lamb, range(5))
    _train(warm, range(5))
    bit = _engine(onebit_lamb(3))
    allreduce = []
    for s in range(8):
        allreduce.append(bit.enable_backward_allreduce)
        if s == 6:
            comm.configure(enabled=True)
        _train(bit, range(s, s + 1))
    rows = sorted(comm.comms_logger.summary_rows())
    comm.configure(enabled=False)
    comm.comms_logger.reset_data()
    straight = _engine(onebit_lamb(3), gradient_clipping=1.0)
    _train(straight, range(5))
    straight.save_checkpoint(ckpt, tag="l5")
    _train(straight, range(5, 9))
    resumed = _engine(onebit_lamb(3), gradient_clipping=1.0)
    resumed.load_checkpoint(ckpt, tag="l5")
    _train(resumed, range(5, 9))
    return {
        "lamb": _params(lamb),
        "warm": _params(warm),
        "bit": _params(bit),
        "coeffs": bit.optimizer.get_lamb_coeffs(),
        "allreduce": allreduce,
        "rows": rows,
        "straight": _params(straight),
        "resumed": _params(resumed),
    }


WIDER = {  # what a resume on more ranks than saved it must carry on with
    "onebit": {"optimizer": onebit(freeze=3)},
    "compressed": {"optimizer": ADAM, "gradient_compression": {"algorithm": "1bit"}},
}


def save_alone(ckpt: str) -> None:
    for name, extra in WIDER.items():
        engine = _engine(**extra)
        _train(engine, range(4))
        engine.save_checkpoint(ckpt, tag=name)


def resume_wider(ckpt: str) -> dict[str, Any]:
    """On 2 ranks from a 1-rank checkpoint: rank 1 has no error-feedback file of its own."""
    out = {}
    for name, extra in WIDER.items():
        engine = _engine(**extra)
        engine.load_checkpoint(ckpt, tag=name)
        out[name] = {"losses": _train(engine, range(4, 7)), "params": _params(engine)}
    return out


class _LateBranch(torch.nn.Module):
    """A branch first used at step 5, after the warm-up, and first in parameter order (the
    state read as the schedule's clock)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.late = torch.nn.Linear(16, 4)
        self.body = mlp()

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.body(x) + self.late(x) if use else self.body(x)


LATE = {
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 3}},
    "ZeroOneAdam-local": zero_one(freeze=3, scaler=2),
    "ZeroOneAdam-variance": zero_one(freeze=100, scaler=1),  # step 5: no variance step
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": 3}},
}


def late_branch() -> dict[str, Any]:
    from deepspeed_ext.runtime.initialize import initialize

    out: dict[str, Any] = {}
    for name, optimizer in LATE.items():
        runs = {}
        for use_from in (5, 99):  # 99: never used, the schedule's reference
            engine, *_ = initialize(
                model=_LateBranch(),
                config={"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer},
            )
            w0 = engine.module.late.weight.detach().clone()
            flags, losses, moved = [], [], []
            for s in range(9):
                flags.append(engine.enable_backward_allreduce)
                x, y = batch(s, engine.dp_rank)
                loss = torch.nn.functional.mse_loss(engine(x, use=s + 1 >= use_from), y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
                moved.append(float((engine.module.late.weight - w0).abs().max()))
            runs[use_from] = {"flags": flags, "losses": losses, "moved": moved}
        out[name] = runs
    return out


class _Tokens(torch.nn.Module):
    """An embedding whose rows 10-19 see no token in the warm-up (a vocabulary not met yet)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def unseen_rows() -> dict[str, Any]:
    """Per optimizer: how far the unseen rows moved after each step, and the losses."""
    from deepspeed_ext.runtime.initialize import initialize

    out: dict[str, Any] = {}
    for name, optimizer in LATE.items():
        engine, *_ = initialize(
            model=_Tokens(), config={"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer}
        )
        w0 = engine.module.embed.weight.detach()[10:].clone()
        moved, losses = [], []
        for s in range(9):
            g = torch.Generator().manual_seed(100 * s + engine.dp_rank)
            ids = torch.randint(0, 10 if s < 5 else 20, (8, 3), generator=g)
            y = torch.randn(8, 3, 4, generator=g)
            loss = torch.nn.functional.mse_loss(engine(ids), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            moved.append(float((engine.module.embed.weight[10:] - w0).abs().max()))
        st = engine.optimizer.state.get(engine.module.embed.weight, {})
        factor = st.get("last_factor")
        out[name] = {
            "moved": moved,
            "losses": losses,
            "factor": None if factor is None else float(factor),
        }
    return out

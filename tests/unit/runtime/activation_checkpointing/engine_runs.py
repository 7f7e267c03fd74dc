"""Rank bodies for test_engine.py (spawned: importable, module level)."""

from __future__ import annotations

from typing import Any

import torch

from .models import Net


def _train(
    mode: str, stage: int, steps: int, extra: dict[str, Any], engines: list | None = None
) -> tuple[list, list]:
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    engine, *_ = deepspeed.initialize(model=Net(mode), config=cfg)
    if engines is not None:
        engines.append(engine)
    rank = torch.distributed.get_rank()
    losses = []
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, the same per mode
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    from deepspeed.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        final = [p.detach().clone() for p in params]
    return losses, final


def modes_match(stages: list[int]) -> dict[str, Any]:
    """Per ZeRO stage: losses and final parameters of reentrant, non-reentrant and
    CPU-checkpointed runs, and whether each equals the run without checkpointing."""
    from deepspeed_ext.runtime.activation_checkpointing import settings

    out: dict[str, Any] = {}
    for stage in stages:
        ref_losses, ref_final = _train("none", stage, 3, {})
        for mode, extra in [
            ("reentrant", {}),
            ("non_reentrant", {}),
            ("reentrant", {"activation_checkpointing": {"cpu_checkpointing": True}}),
        ]:
            losses, final = _train(mode, stage, 3, extra)
            key = f"{stage}-{mode}-{'cpu' if extra else 'device'}"
            out[key] = {
                "losses_equal": losses == ref_losses,
                "params_equal": all(torch.equal(a, b) for a, b in zip(final, ref_final)),
                "cpu_setting": settings.current().cpu_checkpointing,
            }
    # profile: the checkpoints' forward and recompute times reach the metrics line
    engines: list[Any] = []
    profiled = {"activation_checkpointing": {"profile": True}, "steps_per_print": 1}
    _train("reentrant", 0, 2, profiled, engines)
    out["metrics"] = dict(engines[0].metrics.last)
    return out


def _hf_gpt2(ckpt_kwargs: dict[str, Any] | None) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if ckpt_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    model.config.use_cache = False
    return model


def hf_zero3_checkpointing() -> dict[str, bool]:
    """Hugging Face's gradient_checkpointing_enable() under ZeRO 3: losses and weights equal
    the run without it (dropout off), reentrant (HF's default) and not."""
    import deepspeed
    from deepspeed.zero import GatheredParameters

    def train(ckpt_kwargs: dict[str, Any] | None) -> tuple[list[float], list[torch.Tensor]]:
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=_hf_gpt2(ckpt_kwargs), config=cfg)
        engine.train()
        rank = torch.distributed.get_rank()
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            ids = torch.randint(0, 64, (2, 16), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            return losses, [p.detach().clone() for p in params]

    ref_losses, ref_params = train(None)
    out = {}
    for name, kw in [
        ("reentrant", {"use_reentrant": True}),
        ("non_reentrant", {"use_reentrant": False}),
    ]:
        losses, params = train(kw)
        out[name] = losses == ref_losses and all(
            torch.equal(a, b) for a, b in zip(params, ref_params)
        )
    return out

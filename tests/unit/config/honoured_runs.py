"""Runs behind test_honoured_keys.py (importable by spawned ranks)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch import nn

from tests.unit.runtime.models import batch, mlp

LR = 0.1
AVERAGING = {
    "mean": {},
    "sum": {"gradient_allreduce_op": "sum"},
    "prescale": {"prescale_gradients": True},
    "predivide": {"gradient_predivide_factor": 2.0},
}


def _engine(config: dict[str, Any], model: nn.Module | None = None, **kw: Any) -> Any:
    from deepspeed_ext.runtime.initialize import initialize

    base = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}
    engine, *_ = initialize(model=model or mlp(), config={**base, **config}, **kw)
    return engine


def _sgd(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def _params(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed_ext.zero.stage3 import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def averaging() -> dict[str, Any]:
    """One SGD step per (stage, averaging key): the parameter change."""
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        for name, keys in AVERAGING.items():
            if stage == 3 and name == "sum":
                continue  # refused with stage 3 (upstream's rule)
            engine = _engine({"zero_optimization": {"stage": stage}, **keys}, optimizer=_sgd)
            before = _params(engine)
            x, y = batch(0, rank, size=4)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            after = _params(engine)
            out[f"{stage}/{name}"] = {n: after[n] - before[n] for n in before}
            engine.destroy()
    return out


def tags_and_loader(tmp: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    data = torch.utils.data.TensorDataset(torch.randn(18, 16), torch.randn(18, 4))
    for drop in (False, True):
        engine = _engine({"dataloader_drop_last": drop}, optimizer=_sgd, training_data=data)
        out[f"batches drop_last={drop}"] = len(engine.training_dataloader)
        engine.destroy()
    for mode in ("fail", "warn", "ignore"):
        engine = _engine({"checkpoint": {"tag_validation": mode}}, optimizer=_sgd)
        try:
            engine.save_checkpoint(os.path.join(tmp, mode), tag=f"tag{rank}")
            out[mode] = "saved"
        except ValueError as e:
            out[mode] = str(e)
        engine.destroy()
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Probe(nn.Module):
    """Records the dtypes its forward computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((16,), 1.5))
        self.seen: list[tuple[str, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((str(x.dtype), str(self.scale.dtype)))
        return x * self.scale


def fp32_modules() -> dict[str, Any]:
    """fp16_override_modules at stages 0 and 3."""
    out: dict[str, Any] = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = nn.Sequential(Probe(), mlp())
        cfg = {
            "fp16": {"enabled": True, "initial_scale_power": 4},
            "fp16_override_modules": ["Probe"],
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine = _engine(cfg, model, optimizer=_sgd)
        x, y = batch(0, 0, size=4)
        before = _params(engine)["0.scale"]
        result = engine(x.half())
        engine.backward(nn.functional.mse_loss(result.float(), y))
        engine.step()
        probe = engine.module.get_submodule("0")
        out[stage] = {
            "seen": probe.seen[0],
            "out": str(result.dtype),
            "stored": str(_params_dtype(engine, "0.scale")),
            "moved": bool((_params(engine)["0.scale"] != before).any()),
        }
        engine.destroy()
    return out


def _params_dtype(engine: Any, name: str) -> torch.dtype:
    return dict(engine.module.named_parameters())[name].dtype


def single_rank() -> dict[str, Any]:
    from deepspeed_ext.utils.logging import logger

    cap = _Capture()
    logger.addHandler(cap)
    out: dict[str, Any] = {}
    # bf16.check_grad_overflow: a step whose gradients are not finite is skipped, or not
    for check in (True, False):
        model = mlp()
        engine = _engine(
            {"bf16": {"enabled": True, "check_grad_overflow": check}}, model, optimizer=_sgd
        )
        x, y = batch(0, 0, size=4)
        loss = nn.functional.mse_loss(engine(x.bfloat16()).float(), y) * math.inf
        engine.backward(loss)
        engine.step()
        finite = all(bool(p.isfinite().all()) for p in engine.module.parameters())
        out[f"overflow check={check}"] = (engine.skipped_steps, finite)
        engine.destroy()
    # log_level, dump_state, vocabulary_size, timers.throughput, the bucket size in use
    engine = _engine(
        {
            "log_level": "debug",
            "dump_state": True,
            "vocabulary_size": 50257,
            "steps_per_print": 1,
            "timers": {"throughput": {"enabled": False}},
        },
        optimizer=_sgd,
    )
    out["log level"] = logger.level
    x, y = batch(0, 0, size=4)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    out["metrics"] = sorted(engine.metrics.last)
    out["bucket"] = engine.config.zero_optimization.reduce_bucket_size
    engine.destroy()
    logger.setLevel(logging.INFO)
    # zero_optimization.leaf_module and override_module_apply
    from deepspeed_ext.zero.stage3 import Init

    zero = {"stage": 3, "leaf_module": {"names": ["2"], "name_suffixes": ["4"]}}
    patched = {}
    for override in (True, False):
        original = torch.nn.Module.apply
        cfg = {"zero_optimization": {**zero, "override_module_apply": override}}
        with Init(config_dict_or_path=cfg):
            patched[override] = torch.nn.Module.apply is not original
            model = mlp()
    out["apply patched"] = patched
    engine = _engine({"zero_optimization": zero}, model, optimizer=_sgd)
    out["leaves"] = [n for n, m in engine.module.named_modules() if getattr(m, "_z3_leaf", False)]
    x, y = batch(0, 0, size=4)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.destroy()

    # zero_allowed_param_types / zero_force_param_types: which params stage 3 keeps whole
    def normed() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))

    kinds = {
        "force": {"zero_force_param_types": ["LayerNorm"]},
        "allow": {"zero_allowed_param_types": "torch.nn.modules.linear.Linear"},
    }
    for kind, keys in kinds.items():
        zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0, **keys}
        for built in ("engine", "zero.Init"):
            if built == "zero.Init":
                with Init(config_dict_or_path={"zero_optimization": zero3}):
                    model = normed()
            else:
                model = normed()
            engine = _engine({"zero_optimization": zero3}, model, optimizer=_sgd)
            whole = [n for n, p in engine.module.named_parameters() if p.ds_persist]
            out[f"whole {kind} {built}"] = whole
            x, y = batch(0, 0, size=4)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            engine.destroy()
    # the convenience wrapper some guides use
    import json
    import tempfile

    from deepspeed.pt_model import DeepSpeedModel

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0}, f)
    engine = DeepSpeedModel(mlp(), _sgd, config_file=f.name)
    os.unlink(f.name)
    x, y = batch(0, 0, size=4)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    out["pt_model"] = (type(engine).__name__, engine.global_steps)
    engine.destroy()
    # a client optimizer and scheduler replace the config's sections, as upstream documents:
    # said, not silent
    start = len(cap.lines)
    engine = _engine(
        {
            "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
        },
        optimizer=_sgd,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1),
    )
    out["client overrides"] = (type(engine.optimizer).__name__, cap.lines[start:])
    engine.destroy()
    out["log"] = cap.lines
    logger.removeHandler(cap)
    return out

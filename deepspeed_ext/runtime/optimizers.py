"""Building the optimizer a config names (upstream's names and params)."""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

import torch

from deepspeed_ext.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed_ext.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed_ext.ops.lamb import FusedLamb
from deepspeed_ext.ops.lion import DeepSpeedCPULion, FusedLion

from .onebit.adam import OnebitAdam
from .onebit.lamb import OnebitLamb
from .onebit.zoadam import ZeroOneAdam

OUR_NAMES = (
    "adam",
    "adamw",
    "adagrad",
    "lamb",
    "lion",
    "sgd",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
)


def _torch_optimizers() -> dict[str, type]:
    return {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if inspect.isclass(c)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }


class OptimizerConfigError(ValueError):
    pass


def _did_you_mean(exc: Exception) -> str:
    """For "got an unexpected keyword argument 'betaz'": the constructor's closest name."""
    m = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
    if m is None:
        return ""
    cls = next((c for c in _constructors() if c.__name__ == m.group(1)), None)
    if cls is None:
        return ""
    names = list(inspect.signature(cls).parameters)[1:]  # after the params themselves
    close = difflib.get_close_matches(m.group(2), names, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; it takes {', '.join(names)}"


def _constructors() -> list[type]:
    ours = [DeepSpeedCPUAdam, FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion]
    ours += [FusedLamb, OnebitAdam, ZeroOneAdam, OnebitLamb]
    return [*ours, *_torch_optimizers().values()]


def build_optimizer(
    name: str, params: Any, hparams: dict[str, Any], on_cpu: bool, engine: Any = None
) -> torch.optim.Optimizer:
    """`optimizer: {type: name, params: hparams}` -> an optimizer over `params`.

    adam/adamw: our SIMD DeepSpeedCPUAdam for CPU params, FusedAdam for device params
    (torch_adam: true picks torch's); adagrad: our CPU op on CPU, torch's on device; lion: our
    CPU op on CPU, FusedLion on device; lamb: FusedLamb; sgd and any other torch.optim class
    by name.
    """
    key = name.lower()
    hp = dict(hparams)
    try:
        if key in ("adam", "adamw"):
            # upstream pops the key for both types; "AdamW" is decoupled whatever it says
            adamw = bool(hp.pop("adam_w_mode", True)) or key == "adamw"
            hp.pop("adamw_mode", None)
            if hp.pop("torch_adam", False):
                cls = torch.optim.AdamW if adamw else torch.optim.Adam
                return cls(params, **hp)
            if on_cpu:
                return DeepSpeedCPUAdam(params, adamw_mode=adamw, **hp)
            return FusedAdam(params, adam_w_mode=adamw, **hp)
        if key == "adagrad":
            return (
                DeepSpeedCPUAdagrad(params, **hp) if on_cpu else torch.optim.Adagrad(params, **hp)
            )
        if key == "lion":
            return DeepSpeedCPULion(params, **hp) if on_cpu else FusedLion(params, **hp)
        if key == "lamb":
            return FusedLamb(params, **hp)
        if key == "onebitadam":
            return OnebitAdam(params, deepspeed=engine, **hp)
        if key == "zerooneadam":
            return ZeroOneAdam(params, deepspeed=engine, **hp)
        if key == "onebitlamb":
            return OnebitLamb(params, deepspeed=engine, **hp)
        torch_opts = _torch_optimizers()
        if key in torch_opts:
            return torch_opts[key](params, **hp)
    except (TypeError, ValueError) as exc:  # unknown names, or values of the wrong shape
        if isinstance(exc, OptimizerConfigError):
            raise
        raise OptimizerConfigError(
            f"optimizer.params for '{name}' are not accepted: {exc}{_did_you_mean(exc)} "
            f"(given: {hparams})"
        ) from None
    known = sorted(set(OUR_NAMES) | set(_torch_optimizers()))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise OptimizerConfigError(
        f"optimizer.type '{name}' is not a known optimizer.{hint} Known: {', '.join(known)}"
    )

"""Config fuzzing: configs from a few realistic bases, each mutated once (a type flipped, a
key misspelt or dropped, a number out of range, a nested section replaced, a key added),
through the validator (`deepspeed --validate`'s check) and deepspeed.initialize. Counts
uncaught exceptions (anything but a config error) and rejections that name no config key.
Not a speed benchmark: it counts.

    python bench/config_fuzz.py --configs 1000   # -> bench/results/config_fuzz.json
    python bench/config_fuzz.py --smoke          # 60 configs
"""

from __future__ import annotations

import argparse
import copy
import random
import re
import sys
from pathlib import Path
from typing import Any

BASES: dict[str, dict[str, Any]] = {
    "dense_adam": {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
    },
    "zero2_fp16_offload": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 2},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5000,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    },
    "zero3_bf16": {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 100,
            "stage3_prefetch_bucket_size": 1000,
            "stage3_max_live_parameters": 100000,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "checkpoint": {"tag_validation": "warn"},
    },
}

_ODD_VALUES: list[Any] = ["abc", "", [1, 2], {"x": 1}, None, True, -1, 0, 1e30, 2.5, "auto"]


def _paths(cfg: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            here = f"{prefix}.{k}" if prefix else k
            out.append(here)
            out += _paths(v, here)
    return out


def _holder(cfg: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    parts = path.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node[part]
    return node, parts[-1]


def _misspell(key: str, rng: random.Random) -> str:
    i = rng.randrange(len(key))
    how = rng.choice(["drop", "swap", "add"])
    if how == "drop" and len(key) > 2:
        return key[:i] + key[i + 1 :]
    if how == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    return key[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz_") + key[i:]


def mutate(base: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str, str]:
    """(the config, the mutation, the key path it touched)."""
    cfg = copy.deepcopy(base)
    path = rng.choice(_paths(cfg))
    holder, key = _holder(cfg, path)
    kind = rng.choice(["type", "misspell", "drop", "range", "section", "add"])
    if kind == "type":
        holder[key] = rng.choice(_ODD_VALUES)
    elif kind == "misspell":
        new = _misspell(key, rng)
        holder[new] = holder.pop(key)
        path = path[: -len(key)] + new
    elif kind == "drop":
        del holder[key]
    elif kind == "range":
        holder[key] = rng.choice([-1, -1000, 0, 10**12, 1e-12, -0.5])
    elif kind == "section":
        holder[key] = rng.choice([[], "on", 1, {"enabled": "yes"}])
    else:
        new = rng.choice(["enabled", "stage", "lr", "foo_bar", "offload", "type"])
        inside = isinstance(holder[key], dict)
        target = holder[key] if inside else holder
        target[new] = rng.choice(_ODD_VALUES)
        parent = path if inside else path.rpartition(".")[0]
        path = f"{parent}.{new}" if parent else new
    return cfg, kind, path


def _known_keys() -> set[str]:
    from deepspeed_ext.config.support import leaf_fields

    keys: set[str] = set()
    for path, _, _ in leaf_fields():
        parts = path.split(".")
        keys |= {".".join(parts[: i + 1]) for i in range(len(parts))}  # full paths only
    return keys


def names_a_key(message: str, path: str, known: set[str]) -> bool:
    """The message names the key the mutation touched, or another config key by its full
    path (a batch-size error after a dropped key names the triad, say)."""
    if path in message or path.split(".")[-1] in message:
        return True
    return any(tok in known for tok in re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", message))


def validate_one(cfg: dict[str, Any], path: str, known: set[str]) -> tuple[str, str]:
    """("accepted" | "rejected" | "unnamed" | "uncaught", detail) through the validator."""
    import warnings

    from deepspeed_ext.config import ConfigError, validate_config_file

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config_file(cfg, 2, allow_auto=True)
    except ConfigError as e:
        bad = [p for p in e.problems if not names_a_key(p, path, known)]
        return ("unnamed", bad[0]) if bad else ("rejected", e.problems[0])
    except Exception as e:  # noqa: BLE001 - what this counts
        return "uncaught", f"{type(e).__name__}: {e}"
    return "accepted", ""


def initialize_many(cases: list[tuple[dict[str, Any], str]]) -> list[tuple[str, str]]:
    """Each config through deepspeed.initialize on a tiny model (in one process of a world
    of one); a rejection must be a ValueError/TypeError naming a key."""
    import warnings

    import torch

    from deepspeed_ext.runtime.initialize import initialize

    known = _known_keys()
    out = []
    for cfg, path in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine, *_ = initialize(model=model, config=cfg)
            # the data is the harness's: a huge configured micro-batch is the loader's business
            x = torch.randn(min(engine.train_micro_batch_size_per_gpu(), 64), 8)
            loss = engine(x.to(next(engine.module.parameters()).dtype)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            engine.destroy()
            out.append(("accepted", ""))
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            text = str(e)
            out.append(("rejected", text) if names_a_key(text, path, known) else ("unnamed", text))
        except Exception as e:  # noqa: BLE001 - what this counts
            out.append(("uncaught", f"{type(e).__name__}: {e}"))
    return out


def sample(n: int, seed: int) -> list[tuple[dict[str, Any], str, str, str]]:
    rng = random.Random(seed)
    names = sorted(BASES)
    out = []
    for _ in range(n):
        base = rng.choice(names)
        cfg, kind, path = mutate(BASES[base], rng)
        out.append((cfg, base, kind, path))
    return out


def _tally(results: list[str]) -> dict[str, int]:
    return {k: results.count(k) for k in ("accepted", "rejected", "unnamed", "uncaught")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", type=int, default=1000)
    ap.add_argument("--initialize", type=int, help="how many go through initialize (all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.configs, args.initialize = 60, 20
    if args.initialize is None:
        args.initialize = args.configs
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import machine_info, write_result

    from tests.helpers.distributed import run_ranks

    known = _known_keys()
    cases = sample(args.configs, args.seed)
    validated = [validate_one(cfg, path, known) for cfg, _, _, path in cases]
    through = [(cfg, path) for cfg, _, _, path in cases[: args.initialize]]
    initialized = run_ranks(initialize_many, 1, through, timeout=600)[0]
    worst = [
        {"stage": stage, "base": b, "mutation": k, "path": p, "result": res, "detail": d[:300]}
        for stage, results in (("validate", validated), ("initialize", initialized))
        for (_, b, k, p), (res, d) in zip(cases, results)
        if res in ("uncaught", "unnamed")
    ]
    result = {
        "validate": _tally([r for r, _ in validated]),
        "initialize": _tally([r for r, _ in initialized]),
        "failures": worst[:50],
        "configs": args.configs,
        "seed": args.seed,
        "machine": machine_info(),
    }
    for stage in ("validate", "initialize"):
        print(stage, result[stage])
    for f in worst[:10]:
        print("FAIL", f)
    write_result("config_fuzz", result, smoke=args.smoke)


if __name__ == "__main__":
    main()

"""The launcher's pre-flight check (validate_config_file) and `deepspeed --validate` (validate_cli).

Both stay torch-free and fast: they run before any rank is spawned.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from .batch import TRIAD, BatchSizes
from .checks import consistency
from .errors import ConfigError
from .model import DeepSpeedConfig
from .parse import build
from .source import load


def validate_config_file(
    path_or_dict: Mapping[str, Any] | str | os.PathLike[str],
    world_size: int,
    world_size_source: str = "--world_size",
    allow_auto: bool = False,
) -> DeepSpeedConfig:
    """Every check that needs no torch: types, unknown keys, section consistency, the batch
    sizes against this world size, and (unless allow_auto) no "auto" left. Problems found
    after the types check out are reported together."""
    data, source = load(path_or_dict)
    cfg = build(data, source, consistency=False)
    problems = consistency(cfg)
    autos = cfg.unresolved_autos()
    if autos and not allow_auto:
        try:
            cfg.check_resolved()
        except ConfigError as e:
            problems += e.problems
    mp = cfg.model_parallel_size()
    if world_size % mp:
        problems.append(
            f"world size {world_size} ({world_size_source}) is not a multiple of the "
            f"{mp} ranks each model replica needs (tensor_parallel.autotp_size x "
            "pipeline_parallelism.num_stages): launch a multiple of it, or change them"
        )
    elif not any(k in autos for k in TRIAD):
        try:  # the batch is per data-parallel rank: the world over the model-parallel ranks
            dp_source = world_size_source if mp == 1 else f"{world_size_source} / {mp}"
            cfg.resolve_batch(world_size // mp, dp_source)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems, cfg.source)
    return cfg


def summary(cfg: DeepSpeedConfig, sizes: BatchSizes | None) -> str:
    """One line: batch sizes, precision, ZeRO stage, optimizer, scheduler."""
    if sizes is None:
        batch = "batch sizes auto"
    else:
        batch = f"train_batch_size {sizes.train_batch_size} = micro {sizes.micro} x gas {sizes.gas}"
    autos = set(cfg.unresolved_autos())
    if {"fp16.enabled", "bf16.enabled"} & autos:
        precision = "auto"
    else:
        precision = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    return (
        f"{batch}; precision {precision}; ZeRO stage {cfg.zero_optimization.stage}; "
        f"optimizer {cfg.optimizer.type or 'none'}; scheduler {cfg.scheduler.type or 'none'}"
    )


def _arguments(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deepspeed_ext.config",
        description="Check a DeepSpeed config against a world size (no torch, no ranks).",
    )
    p.add_argument("config", nargs="?", help="the DeepSpeed config JSON file")
    # The launcher may hand over its own argv: `deepspeed --validate cfg.json --world_size N`.
    p.add_argument("--validate", metavar="CONFIG", help="the config (launcher spelling)")
    p.add_argument("--world_size", type=int, default=None, help="ranks to check against")
    p.add_argument("--world_size_source", default=None, help="what chose the world size")
    p.add_argument("--allow_auto", action="store_true", help='accept "auto" values')
    args = p.parse_known_args(argv)[0]
    args.config = args.validate or args.config
    if args.config is None:
        p.error("no config file given")
    return args


def _world_size(args: argparse.Namespace) -> tuple[int, str]:
    if args.world_size is not None:
        return args.world_size, args.world_size_source or f"--world_size {args.world_size}"
    env = os.environ.get("WORLD_SIZE")
    if env and env.isdigit():
        return int(env), args.world_size_source or f"WORLD_SIZE={env} in the environment"
    return 1, args.world_size_source or "the default world size 1 (no --world_size given)"


def validate_cli(argv: list[str] | None = None) -> int:
    """`deepspeed --validate cfg.json --world_size N`: print "OK: ..." and return 0, or print
    the problems and return 1 (2 for a usage error). Other launcher flags in argv are ignored.
    Without --world_size: $WORLD_SIZE, else 1."""
    try:
        args = _arguments(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse printed the usage (or --help); hand back its status
        return int(e.code or 0)
    world_size, source = _world_size(args)
    try:
        cfg = validate_config_file(args.config, world_size, source, allow_auto=args.allow_auto)
    except ConfigError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    autos = cfg.unresolved_autos()
    sizes = None if any(k in autos for k in TRIAD) else cfg.resolve_batch(world_size, source)
    print(f"OK: {args.config} (world_size {world_size}): {summary(cfg, sizes)}")
    return 0

"""Config keys that act once, as the engine starts: the log level, the keys that have no
effect here (said once, [Note: config honesty]), breakdowns nothing would show, upstream's
vocabulary-size hint, and dump_state."""

from __future__ import annotations

import json
import logging
from typing import Any

from deepspeed_ext.config import support
from deepspeed_ext.monitor import monitors_enabled
from deepspeed_ext.utils.logging import logger

# Tensor cores want matrix sides in multiples of 8 (upstream's hint uses the same).
_TENSOR_CORE_ALIGN = 8


def at_start(config: Any, pipeline: bool) -> None:
    if config.log_level is not None:
        level = logging.getLevelName(str(config.log_level).upper())
        if not isinstance(level, int):
            raise ValueError(
                f"log_level {config.log_level!r} is not a logging level; use one of debug, "
                "info, warning, error, critical"
            )
        logger.setLevel(level)
        if config.steps_per_print is not None and level > logging.INFO:
            # the metrics line is an INFO record: asked for, and hidden by the same config
            logger.warning(
                f"steps_per_print is {config.steps_per_print} but log_level "
                f"{config.log_level!r} hides the metrics line (an info record): set log_level "
                "to info, or enable a monitor (jsonl_monitor, ...) for the metrics"
            )
    shown = config.steps_per_print is not None or monitors_enabled(config)
    on = [k for k in ("wall_clock_breakdown", "memory_breakdown") if getattr(config, k)]
    if on and not shown:  # measured, and never shown: the metrics line and monitors show them
        logger.warning(
            f"{' and '.join(on)} {'is' if len(on) == 1 else 'are'} on, but nothing shows "
            "them: set steps_per_print (the metrics line every N steps) or enable a "
            "monitor (jsonl_monitor, csv_monitor, tensorboard, ...)"
        )
    for line in [*support.noted(config), *support.stage_mismatched(config)]:
        logger.warning(line)
    if not pipeline:
        unused = support.pipeline_only_set(config)
        if unused:
            logger.warning(
                f"{support.keys_have(unused)} no effect: the "
                "model is not a pipeline (give deepspeed.initialize a deepspeed.pipe."
                "PipelineModule, or an nn.Sequential with pipeline_parallelism.num_stages)"
            )
    vocab = config.vocabulary_size
    if vocab is not None and vocab % _TENSOR_CORE_ALIGN:
        logger.warning(
            f"vocabulary_size {vocab} is not a multiple of {_TENSOR_CORE_ALIGN}: the embedding "
            "and output layers run slower on tensor cores; pad the vocabulary"
        )


def dump_state(engine: Any) -> None:
    """dump_state: the engine's effective set-up, once, on rank 0."""
    if not engine.config.dump_state:
        return
    state = {
        "layout": engine.layout.describe(),
        "zero_stage": engine.zero_optimization_stage(),
        "strategy": type(engine.strategy).__name__,
        "optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
        "lr_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler else None,
        "loss_scaler": type(engine.loss_scaler).__name__ if engine.loss_scaler else None,
        "batch": {
            "train_batch_size": engine.train_batch_size(),
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        },
        "config": engine.config.to_dict(),
    }
    logger.info("engine state:\n" + json.dumps(state, indent=2, default=str))

"""A one-stage pipeline in this process: the engine's API, and the config it refuses by name
before any collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepspeed_ext.runtime.initialize import initialize
from deepspeed_ext.runtime.pipe import PipelineError, PipelineModule

from . import pipe_runs as pr


def module(**kw: Any) -> PipelineModule:
    args: dict[str, Any] = dict(num_stages=1, loss_fn=pr.lm_loss, seed_layers=True)
    args.update(kw)
    return PipelineModule(pr.specs(), **args)


def config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": pr.MICRO, "gradient_accumulation_steps": 2, **extra}


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=pr.LR)


def test_one_stage_matches_the_reference() -> None:
    engine, *_ = initialize(
        model=module(), config=config(gradient_clipping=pr.CLIP), optimizer=adamw
    )
    assert engine.is_first_stage() and engine.is_last_stage()
    losses = [float(engine.train_batch(iter(pr.batches(s, 0, 2)))) for s in range(3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(pr.reference(3, 2, 1)["losses"]))
    assert engine.global_steps == 3 and engine.micro_steps == 6
    assert engine.global_samples == 3 * 2 * pr.MICRO


def test_training_data_feeds_train_batch() -> None:
    data = [pr.micro_batch(0, 0, i) for i in range(3)]
    dataset = [(ids[0], labels[0]) for ids, labels in data]  # samples, batched by the loader
    engine, _, loader, _ = initialize(
        model=module(), config=config(), optimizer=adamw, training_data=dataset
    )
    assert loader is not None
    for _ in range(3):  # more micro-batches than the loader holds: it repeats
        assert torch.isfinite(engine.train_batch())


def test_micro_batch_api_is_refused() -> None:
    engine, *_ = initialize(model=module(), config=config(), optimizer=adamw)
    with pytest.raises(PipelineError, match="train_batch"):
        engine(torch.zeros(1))
    with pytest.raises(PipelineError, match="train_batch"):
        engine.step()
    with pytest.raises(PipelineError, match="no data iterator"):
        engine.train_batch()


@pytest.mark.parametrize(
    ("extra", "kw", "match"),
    [
        ({"zero_optimization": {"stage": 3}}, {}, "stage 3 does not run with pipeline"),
        ({"pipeline": {"stages": 2}}, {}, "pipeline.stages is 2"),
        ({"pipeline": {"partition": "uniform"}}, {}, "pipeline.partition is 'uniform'"),
        ({"pipeline": {"activation_checkpoint_interval": 2}}, {}, "activation_checkpoint_interval"),
        ({"pipeline": {"seed_layers": False}}, {}, "pipeline.seed_layers"),
    ],
)
def test_config_disagreeing_with_the_module_is_refused(extra: Any, kw: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        initialize(model=module(**kw), config=config(**extra), optimizer=adamw)


def test_config_agreeing_with_the_module_is_fine() -> None:
    cfg = config(pipeline={"stages": 1, "partition": "best", "seed_layers": True})
    initialize(model=module(), config=cfg, optimizer=adamw)


def test_config_key_refuses_a_model_it_cannot_cut() -> None:
    with pytest.raises(ValueError, match="torch.nn.Sequential or a list of layers"):
        initialize(
            model=pr.Reference(),
            config=config(pipeline_parallelism={"num_stages": 1}),
            optimizer=adamw,
        )


def test_mpu_beside_a_pipeline_module_is_refused() -> None:
    with pytest.raises(ValueError, match="drop mpu="):
        initialize(model=module(), config=config(), optimizer=adamw, mpu=object())

"""A checkpoint written by upstream DeepSpeed's PipelineEngine (tests/data/upstream_pipe_ckpt,
written by its make.py under upstream 0.19.8: 2 stages, stage-0 AdamW, saved after step 2)
resumes here ([Note: upstream pipeline checkpoints]). At the same 2 stages, with its
optimizer state, the next two steps' losses equal upstream's own continuation (an optimizer
grouped otherwise is refused its state by name). At 1 stage the
weights load (the first loss, computed before any update, equals upstream's), and its
optimizer state, which upstream stores by position per stage, is refused by name unless
load_optimizer_states=False."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.errors import error_text

from . import upstream_model as um

FIXTURE = Path(__file__).resolve().parents[3] / "data" / "upstream_pipe_ckpt"


def _engine(stages: int, groups: int = 1) -> Any:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    module = PipelineModule(
        um.specs(LayerSpec, TiedLayerSpec),
        num_stages=stages,
        loss_fn=um.lm_loss,
        partition_method="uniform",
    )
    cfg = {
        "train_micro_batch_size_per_gpu": um.MICRO,
        "gradient_accumulation_steps": um.GAS,
        "gradient_clipping": 0.0,  # as the fixture was written (make.py says why)
    }

    def adamw(params: Any) -> Any:
        ps = list(params)  # a flat list: no model_parameters given (upstream's call)
        gs: Any = ps
        if groups == 2:  # weights and the rest, as Megatron groups them
            gs = [
                {"params": [p for p in ps if p.dim() > 1]},
                {"params": [p for p in ps if p.dim() < 2]},
            ]
        return torch.optim.AdamW(gs, lr=um.LR)

    engine, *_ = initialize(model=module, config=cfg, optimizer=adamw)
    return engine


def _steps(engine: Any) -> list[float]:
    out = []
    for step in (2, 3):
        reads = engine.is_first_stage() or engine.is_last_stage()
        out.append(float(engine.train_batch(iter(um.batches(step)) if reads else None)))
    return out


def resume_two_stages() -> dict[str, Any]:
    grouped = _engine(2, groups=2)
    refused = error_text(lambda: grouped.load_checkpoint(str(FIXTURE)))
    engine = _engine(2)
    path, _ = engine.load_checkpoint(str(FIXTURE))
    return {
        "path": path,
        "steps": engine.global_steps,
        "losses": _steps(engine),
        "refused": refused,
    }


def resume_one_stage() -> dict[str, Any]:
    engine = _engine(1)
    refused = error_text(lambda: engine.load_checkpoint(str(FIXTURE)))
    engine = _engine(1)
    engine.load_checkpoint(str(FIXTURE), load_optimizer_states=False)
    return {"refused": refused, "steps": engine.global_steps, "losses": _steps(engine)}


def _upstream() -> list[float]:
    return json.loads((FIXTURE / "upstream_losses.json").read_text())["losses"]


def test_same_stages_resume_as_upstream_continued() -> None:
    for r in run_ranks(resume_two_stages, 2):
        assert r["path"].endswith("step2") and r["steps"] == 2
        # an optimizer grouped otherwise cannot take upstream's state by position
        assert "parameter groups hold" in r["refused"], r["refused"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(_upstream()[2:]))


def test_another_stage_count_loads_the_weights_and_refuses_the_optimizer_by_name() -> None:
    (r,) = run_ranks(resume_one_stage, 1)
    assert r["refused"].startswith("CheckpointError"), r["refused"]
    assert "load_optimizer_states=False" in r["refused"] and "upstream" in r["refused"]
    assert r["steps"] == 2
    torch.testing.assert_close(torch.tensor(r["losses"][0]), torch.tensor(_upstream()[2]))

"""A tiny GPT-like model as pipeline layers, its data, and runs shared by the pipeline tests
(importable by spawned ranks). The single-process reference trains the same layers on the
same global batches with torch.optim.AdamW and torch's clip_grad_norm_."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

VOCAB, DIM, SEQ, BLOCKS = 32, 16, 6, 4
MICRO, LR, CLIP = 2, 1e-2, 0.5


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def project(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    """The tied output head: the embedding's weight used again as the projection."""
    return x @ embed.weight.t()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def specs(tied: bool = True, blocks: int = BLOCKS) -> list[Any]:
    from deepspeed_ext.runtime.pipe import LayerSpec, TiedLayerSpec

    head: Any = (
        TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=project)
        if tied
        else LayerSpec(nn.Linear, DIM, VOCAB)
    )
    return [
        TiedLayerSpec("embed", Embed, VOCAB, DIM),
        *[LayerSpec(Block, DIM) for _ in range(blocks)],
        LayerSpec(nn.LayerNorm, DIM),
        head,
    ]


def micro_batch(step: int, dp_rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * dp_rank + mb)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def batches(step: int, dp_rank: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [micro_batch(step, dp_rank, mb) for mb in range(gas)]


# -- the single-process reference --
class Reference(nn.Module):
    """The same layers, seeded as PipelineModule(seed_layers=True) seeds them."""

    def __init__(self, tied: bool = True, base_seed: int = 1234, blocks: int = BLOCKS) -> None:
        super().__init__()
        layers = []
        self.embed: Embed | None = None
        for idx, spec in enumerate(specs(tied, blocks)):
            torch.manual_seed(base_seed + idx)
            if getattr(spec, "key", None) == "embed" and self.embed is not None:
                layers.append(None)  # the tied head: reuses the embedding
                continue
            module = spec.build()
            if self.embed is None and isinstance(module, Embed):
                self.embed = module
            layers.append(module)
        self.layers = nn.ModuleList([m for m in layers if m is not None])
        self.tied_head = layers[-1] is None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for m in self.layers:
            x = m(x)
        return project(self.embed, x) if self.tied_head else x  # type: ignore[arg-type]


def reference(
    steps: int,
    gas: int,
    dp: int,
    tied: bool = True,
    data: Any = None,
    warmup: int = 0,
    blocks: int = BLOCKS,
    freeze: Any = None,
    optimizer: Any = None,
) -> dict[str, Any]:
    """data(step, dp_rank, gas) -> micro-batches (default: batches); warmup: WarmupLR steps
    (the engine's scheduler, itself tested against its formula); freeze(model) freezes
    what the run under test freezes; optimizer(model) -> (optimizer, scheduler or None)
    builds what it builds."""
    data = data or batches
    model = Reference(tied, blocks=blocks)
    if freeze is not None:
        freeze(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched: Any = None
    if optimizer is not None:
        opt, sched = optimizer(model)
    if warmup:
        from deepspeed_ext.runtime.lr_schedules import get_lr_scheduler

        sched = get_lr_scheduler("WarmupLR", opt, {"warmup_num_steps": warmup})
    losses, aux, sums = [], [], []
    for step in range(steps):
        total, sq = 0.0, 0.0
        sums.append([0.0] * dp)
        for d in range(dp):
            for ids, labels in data(step, d, gas):
                logits = model(ids)
                loss = lm_loss(logits, labels)
                (loss / (gas * dp)).backward()
                total += float(loss.detach()) / (gas * dp)
                sums[-1][d] += float(loss.detach())
                sq += float(logits.detach().float().pow(2).mean()) / (gas * dp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
        aux.append(sq)
    return {
        "losses": losses,
        "aux": aux,  # AuxPipe's additional loss: the batch mean of the logits' mean square
        "sums": sums,  # [step][data rank]: the sum of that rank's micro-batch losses
        "params": [p.detach().clone() for p in model.parameters()],
        "model": model,
    }


def decay_groups(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """Megatron's and Hugging Face's optimizer: weight decay on the matrices only, in a
    group of its own; and a torch scheduler built on it (its lr falls every step)."""
    params = list(model.parameters())  # frozen ones too, as users build it
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 2 * step))


# -- the pipeline run (in each spawned rank) --
def aux_pipe(*args: Any, v: bool = False, **kwargs: Any) -> Any:
    """A PipelineModule (a DualPipeVModule when `v`) with upstream's get_additional_losses
    hook: the mean square of the last stage's output, returned on the loss stage only."""
    from deepspeed_ext.runtime.pipe import DualPipeVModule, PipelineModule

    base: Any = DualPipeVModule if v else PipelineModule

    class AuxPipe(base):  # type: ignore[misc,valid-type]
        def forward(self, forward_input: Any, chunk: int = 0) -> Any:
            out = super().forward(forward_input, chunk)
            self._aux = out.detach().float().pow(2).mean()
            return out

        def get_additional_losses(self) -> Any:
            return {"logits_sq": self._aux} if self.stage_id == self.loss_stage_id else None

    return AuxPipe(*args, **kwargs)


def pipeline_run(
    stages: int,
    zero: int,
    dtype: str,
    steps: int,
    gas: int,
    tied: bool = True,
    chunks: int = 1,
    schedule: str | None = None,
    blocks: int = BLOCKS,
) -> dict[str, Any]:
    from deepspeed_ext.runtime.initialize import initialize

    v = schedule is not None and schedule.startswith("dualpipev")
    module = aux_pipe(
        specs(tied, blocks),
        v=v,
        num_stages=stages,
        loss_fn=lm_loss,
        seed_layers=True,
        partition_method="uniform",
        **({} if v else {"virtual_stages": chunks}),
    )
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero},
    }
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = initialize(
        model=module, config=cfg, optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR)
    )
    dp_rank = engine.grid.get_data_parallel_id()
    losses, aux, own, sums = [], [], [], []
    for step in range(steps):
        it = iter(batches(step, dp_rank, gas)) if engine._needs_data() else None
        losses.append(float(engine.train_batch(it)))
        aux.append(float(engine.agg_additional_losses["logits_sq"]))
        own.append(float(engine.dp_group_loss))
        sums.append(None if engine.total_loss is None else float(engine.total_loss))
    # this stage's weights, named by global layer index (tied modules by their first use)
    weights = {}
    for name, p in module.named_parameters():
        weights[name] = p.detach().float().clone()
    return {
        "rank": int(os.environ["RANK"]),
        "stage": engine.stage_id,
        "loss_stage": engine.is_last_stage(),
        "dp": dp_rank,
        "parts": module.parts,
        "losses": losses,
        "aux": aux,
        "dp_group_loss": own,
        "total_loss": sums,
        "weights": weights,
        "schedule": engine.schedule_name,
        "unsplit": engine.unsplit_backwards,
        # [Note: pipeline p2p]: receives posted early, none left posted after a batch
        "early": [(ch.early_receives, ch._early is not None) for ch in _receivers(engine)],
    }


def _receivers(engine: Any) -> list[Any]:
    return [*engine._act_in.values(), *engine._grad_in.values()]


def pipeline_cases(cases: list[tuple[Any, ...]], steps: int, gas: int) -> list[dict[str, Any]]:
    """Several configurations in one set of spawned ranks (spawning is the slow part):
    (stages, zero stage, dtype[, model chunks per rank or a pipeline.schedule name[,
    {"gas": ..., "blocks": ...} overrides]])."""
    out = []
    for c in cases:
        extra = c[3] if len(c) > 3 else 1
        chunks, schedule = (1, extra) if isinstance(extra, str) else (extra, None)
        over = c[4] if len(c) > 4 else {}
        out.append(
            pipeline_run(
                c[0],
                c[1],
                c[2],
                steps,
                over.get("gas", gas),
                chunks=chunks,
                schedule=schedule,
                blocks=over.get("blocks", BLOCKS),
            )
        )
    return out


# -- additional losses over a changing schedule (2 stages x 2 data-parallel ranks) --
def planned_losses(step: int, dp: int, mb: int) -> dict[str, torch.Tensor] | None:
    """What the last stage's get_additional_losses returns, by step, data rank and
    micro-batch: none; a scalar and a vector; a name in one micro-batch only; none; the
    first names again; names in another order on data rank 1; names on data rank 0 only."""

    def v(off: float = 0.0) -> float:
        return float(100 * step + 10 * dp + mb + off)

    if step in (1, 4):
        return {"a": torch.tensor(v()), "vec": torch.tensor([v(k) for k in range(3)])}
    if step == 2:
        return {"b": torch.tensor(v())} if mb == 1 else None
    if step == 5:
        a, b = torch.tensor(1.0 + dp), torch.tensor(10.0 * (dp + 1))
        return {"a": a, "b": b} if dp == 0 else {"b": b, "a": a}
    if step == 6:
        return {"a": torch.tensor(5.0)} if dp == 0 else None
    return None


def additional_losses_schedule() -> dict[str, Any]:
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule

    class Planned(PipelineModule):
        step, dp, mb = 0, 0, 0

        def forward(self, forward_input: Any, chunk: int = 0) -> Any:
            self.mb += 1
            return super().forward(forward_input, chunk)

        def get_additional_losses(self) -> Any:
            return planned_losses(self.step, self.dp, self.mb - 1)

    module = Planned(
        specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform"
    )
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2}
    engine, *_ = initialize(
        model=module, config=cfg, optimizer=lambda g: torch.optim.AdamW(g, lr=LR)
    )
    module.dp = engine.grid.get_data_parallel_id()
    out: dict[str, Any] = {"agg": []}
    for step in range(7):
        module.step, module.mb = step, 0
        it = iter(batches(step, module.dp, 2)) if engine._needs_data() else None
        try:
            engine.train_batch(it)
        except ValueError as e:
            out["error"] = (step, str(e))
            break
        agg = engine.agg_additional_losses
        out["agg"].append(None if agg is None else {k: v.tolist() for k, v in agg.items()})
        if step == 1:  # an eval batch collects nothing
            module.step, module.mb = 4, 0
            it = iter(batches(50, module.dp, 2)) if engine._needs_data() else None
            before = engine.total_additional_losses
            engine.eval_batch(it)
            out["eval_left_totals"] = engine.total_additional_losses is before
    return out

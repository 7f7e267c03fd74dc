"""Two-stage pipeline scenarios run in one pair of spawned ranks (spawning is the slow part):
eval_batch, activation checkpointing, fp16, the pipeline_parallelism key on an nn.Sequential
passing (activations, int mask) tuples between stages, dynamic shapes, and the errors a
broken pipeline must raise on every rank instead of hanging. Error scenarios run last."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import pipe_runs as pr


def _engine(module: Any, gas: int = 2, **extra: Any) -> Any:
    from deepspeed_ext.runtime.initialize import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": pr.MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": pr.CLIP,
        **extra,
    }
    # the config's optimizer when it has one, else torch's AdamW
    client = None if "optimizer" in cfg else (lambda g: torch.optim.AdamW(g, lr=pr.LR))
    engine, *_ = initialize(model=module, config=cfg, optimizer=client)
    return engine


def _module(aux: bool = False, **kw: Any) -> Any:
    from deepspeed_ext.runtime.pipe import PipelineModule

    args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
    args.update(kw)
    return (pr.aux_pipe if aux else PipelineModule)(pr.specs(), **args)


def _train(engine: Any, steps: int, gas: int = 2) -> list[float]:
    out = []
    for step in range(steps):
        it = iter(pr.batches(step, 0, gas)) if engine._needs_data() else None
        out.append(float(engine.train_batch(it)))
    return out


def eval_after_training() -> dict[str, Any]:
    from deepspeed_ext.accelerator import strict

    engine = _engine(_module())
    losses = _train(engine, 2)
    # the batch loss lives where the stage computes, as upstream's (NCCL can reduce it)
    on_device = not strict.is_host(engine.agg_train_loss)
    data = pr.batches(99, 0, 3)
    it = iter(data) if engine._needs_data() else None
    loss, logits = engine.eval_batch(it, return_logits=True, num_micro_batches=3)
    total = engine.total_loss  # the last stage's sum of this eval batch's losses
    again = engine.eval_batch(iter(data) if engine._needs_data() else None)  # gas=2 batches
    return {
        "losses": losses,
        "total_loss": None if total is None else float(total),
        "on_device": on_device,
        "eval": float(loss),
        "eval2": float(again),
        "logits": None if logits is None else list(logits.shape),
    }


def _recv_buffers(engine: Any) -> int:
    """The most receive buffers any of this rank's channels holds."""
    chans = [*engine._act_in.values(), *engine._grad_in.values()]
    return max((len(ch._slots) for ch in chans), default=0)


class _Double(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def interleaved() -> dict[str, Any]:
    """Interleaved train and eval; the receive buffers stay as many as the micro-batches in
    flight (not one per micro-batch of the batch); and eval outputs of a last stage that
    passes its received input through are the micro-batches' own, not views into a reused
    receive buffer."""
    engine = _engine(_module(virtual_stages=2))
    losses = _train(engine, 2)
    data = pr.batches(99, 0, 3)
    it = iter(data) if engine._needs_data() else None
    loss = engine.eval_batch(it, num_micro_batches=3)
    many = pr.batches(98, 0, 12)
    engine.eval_batch(iter(many) if engine._needs_data() else None, num_micro_batches=12)
    from deepspeed_ext.runtime.pipe import PipelineModule

    # the last stage holds no parameter at all
    through = _engine(PipelineModule([_Double(), nn.Identity()], num_stages=2), gas=3)
    xs = [(torch.full((2, 3), float(i)), torch.zeros(2)) for i in range(3)]
    outs = through.eval_batch(iter(xs), compute_loss=False, reduce_output=None)
    return {
        "losses": losses,
        "eval": float(loss),
        "schedule": engine.schedule_name,
        "recv_buffers": _recv_buffers(engine),
        "passed_through": [t.tolist() for t in outs] if through.is_last_stage() else None,
    }


def dualpipev() -> dict[str, Any]:
    """DualPipeV on 2 ranks (4 stages as a V): a batch of 3 micro-batches is refused by
    name; 4 train as the reference does; eval_batch (any count) returns the loss and, on
    stage 0 where the loss is, the logits; and a model given as an nn.Sequential with the
    pipeline_parallelism key and pipeline.schedule "dualpipev" is cut as a V, passing
    (activations, int mask) tuples through the turn."""
    from deepspeed_ext.runtime.pipe import DualPipeVModule

    def v_module(**kw: Any) -> Any:
        args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
        return DualPipeVModule(pr.specs(), **{**args, **kw})

    try:
        _engine(v_module(), gas=3)
        refused = ""
    except ValueError as e:
        refused = str(e)
    try:
        _engine(v_module(), gas=4, pipeline={"schedule": "zb-h1"})
        other = ""
    except ValueError as e:
        other = str(e)
    engine = _engine(v_module(), gas=4)
    losses = _train(engine, 2, gas=4)
    # NCCL ignores tags: with every channel's tag the same, as NCCL would see them, each
    # edge's own process group still keeps chunk 0's activations and chunk 1's gradients
    # (one way between the same two ranks) apart
    untagged = _engine(v_module(), gas=4)
    for ch in [*untagged._act_in.values(), *untagged._act_out.values()]:
        ch.tag = 0
    for ch in [*untagged._grad_in.values(), *untagged._grad_out.values()]:
        ch.tag = 0
    untagged_losses = _train(untagged, 2, gas=4)
    data = pr.batches(99, 0, 3)
    it = iter(data) if engine._needs_data() else None
    loss, logits = engine.eval_batch(it, return_logits=True, num_micro_batches=3)
    as_v = {"schedule": "dualpipev"}
    keyed = _engine(sequential(), gas=4, pipeline_parallelism={"num_stages": 2}, pipeline=as_v)
    positional = DualPipeVModule(pr.specs(), 2, None, pr.lm_loss, True)  # upstream's order
    from deepspeed_ext.config import parse
    from deepspeed_ext.runtime.pipe import PipelineEngine

    cfg = parse({"train_micro_batch_size_per_gpu": pr.MICRO, "gradient_accumulation_steps": 4})
    try:
        PipelineEngine(positional, cfg)
        plain_engine = ""
    except TypeError as e:
        plain_engine = str(e)
    dyn = _engine(v_module(dynamic_shape=True), gas=4)
    ragged = []
    for step in range(2):
        it = iter(_ragged(step, 4)) if dyn._needs_data() else None
        ragged.append(float(dyn.train_batch(it)))
    return {
        "refused": refused,
        "other_schedule": other,
        "positional": (positional.loss_fn is pr.lm_loss, positional.seed_layers),
        "plain_engine": plain_engine,
        "engine": type(engine).__name__,
        "losses": losses,
        "untagged": untagged_losses,
        "eval": float(loss),
        "total_loss": None if engine.total_loss is None else float(engine.total_loss),
        "logits": None if logits is None else list(logits.shape),
        "keyed": {
            "type": type(keyed.module).__name__,
            "parts": keyed.module.parts,
            "losses": _train(keyed, 2, gas=4),
        },
        "ragged": ragged,
    }


def checkpointed() -> dict[str, Any]:
    engine = _engine(_module(activation_checkpoint_interval=1))
    return {"losses": _train(engine, 3)}


def fp16(power: int = 8, **extra: Any) -> dict[str, Any]:
    engine = _engine(_module(), fp16={"enabled": True, "initial_scale_power": power}, **extra)
    losses = _train(engine, 3)
    return {
        "losses": losses,
        "scale": engine.loss_scaler.loss_scale if engine.loss_scaler else 1.0,
        "skipped": engine.skipped_steps,
    }


def timed() -> dict[str, Any]:
    """wall_clock_breakdown: each stage's window times, by upstream's timer names; then an
    eval batch, whose loss the jsonl monitor (rank 0) gets as upstream's eval_loss event."""
    import json
    import tempfile

    out = tempfile.mkdtemp(prefix="pipe_monitor_")
    monitor = {"enabled": True, "output_path": out, "job_name": "run"}
    engine = _engine(
        _module(aux=True), wall_clock_breakdown=True, steps_per_print=2, jsonl_monitor=monitor
    )
    losses = _train(engine, 2)
    window = dict(engine.metrics.last)
    data = pr.batches(99, 0, 3)
    loss = engine.eval_batch(iter(data) if engine._needs_data() else None, bcast_loss=False)
    engine.destroy()
    path = Path(out) / "run" / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    return {"losses": losses, "window": window, "eval": float(loss), "rows": rows}


def _reentrant(function: Any, *args: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=True)


def _ours_reentrant(function: Any, *args: Any) -> Any:
    from deepspeed_ext.runtime.activation_checkpointing import checkpoint

    return checkpoint(function, *args)  # deepspeed.checkpointing's: reentrant


def zero_bubble(checkpoint_func: Any = None) -> dict[str, Any]:
    """ZB-H1 with activation checkpointing: non-reentrant splits; reentrant runs whole."""
    kw: dict[str, Any] = {}
    if checkpoint_func is not None:  # not the embedding: token ids need no gradient
        kw = {"activation_checkpoint_func": checkpoint_func, "checkpointable_layers": ["Block"]}
    engine = _engine(
        _module(activation_checkpoint_interval=1, **kw), gas=4, pipeline={"schedule": "zb-h1"}
    )
    losses = _train(engine, 3, gas=4)
    return {"losses": losses, "schedule": engine.schedule_name, "unsplit": engine.unsplit_backwards}


# -- an nn.Sequential passing (activations, mask) tuples, cut by the config key --
class MaskIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(pr.VOCAB, pr.DIM)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(ids), (ids % 3 != 0).long()  # an int mask rides along


class MaskedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(pr.DIM, pr.DIM)

    def forward(self, xm: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = xm
        return x + torch.tanh(self.lin(x)) * mask.unsqueeze(-1), mask


class MaskOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(pr.DIM, pr.VOCAB)

    def forward(self, xm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.head(xm[0])


def sequential() -> nn.Sequential:
    torch.manual_seed(7)
    model = nn.Sequential(MaskIn(), MaskedLinear(), MaskedLinear(), MaskedLinear(), MaskOut())
    model.loss_fn = pr.lm_loss  # picked up by the pipeline_parallelism key
    return model


def sequential_reference(steps: int, gas: int) -> list[float]:
    model = sequential()
    opt = torch.optim.AdamW(model.parameters(), lr=pr.LR)
    out = []
    for step in range(steps):
        total = 0.0
        for ids, labels in pr.batches(step, 0, gas):
            loss = pr.lm_loss(model(ids), labels)
            (loss / gas).backward()
            total += float(loss.detach()) / gas
        torch.nn.utils.clip_grad_norm_(model.parameters(), pr.CLIP)
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def config_key() -> dict[str, Any]:
    engine = _engine(sequential(), pipeline_parallelism={"num_stages": 2})
    engine.set_has_attention_mask(True)  # upstream's call for a mask between stages
    try:
        engine.set_has_attention_mask(1)
        refused = ""
    except TypeError as e:
        refused = str(e)
    return {"losses": _train(engine, 3), "parts": engine.module.parts, "refused": refused}


# -- shapes --
def _ragged(step: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step 1's micro-batches are shorter sequences."""
    out = []
    for ids, labels in pr.batches(step, 0, gas):
        cut = pr.SEQ - 2 if step == 1 else pr.SEQ
        out.append((ids[:, :cut], labels[:, :cut]))
    return out


def dynamic_shapes() -> dict[str, Any]:
    engine = _engine(_module(dynamic_shape=True))
    losses = []
    for step in range(3):
        it = iter(_ragged(step, 2)) if engine._needs_data() else None
        losses.append(float(engine.train_batch(it)))
    return {"losses": losses}


def reset_shapes() -> dict[str, Any]:
    """Static shapes, with upstream's reset_activation_shape() before step 1 (shorter) and
    GPT-NeoX's way, `engine.first_output_send = True`, before step 2 (full length)."""
    engine = _engine(_module())
    losses = []
    for step in range(3):
        if step == 1:
            engine.reset_activation_shape()
        if step == 2:
            engine.first_output_send = True
        it = iter(_ragged(step, 2)) if engine._needs_data() else None
        losses.append(float(engine.train_batch(it)))
    return {"losses": losses}


def _expect_failure(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


def shape_change() -> dict[str, Any]:
    engine = _engine(_module())

    def run() -> None:
        for step in range(3):
            it = iter(_ragged(step, 2)) if engine._needs_data() else None
            engine.train_batch(it)

    return _expect_failure(run)


def missing_iterator() -> dict[str, Any]:
    engine = _engine(_module())
    it = iter(pr.batches(0, 0, 2)) if engine.is_first_stage() else None  # last stage lacks one
    return _expect_failure(lambda: engine.train_batch(it))


def iterator_lost_later() -> dict[str, Any]:
    """After the first batch the stage finds it has no iterator as it reads its
    micro-batches; the ranks agree on that before any p2p, so its neighbour fails too."""
    engine = _engine(_module())
    _train(engine, 1)
    it = iter(pr.batches(1, 0, 2)) if engine.is_first_stage() else None
    engine.data_iterator = None if not engine.is_first_stage() else engine.data_iterator
    return _expect_failure(lambda: engine.train_batch(it))


class _WithNone(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class _First(nn.Module):
    def forward(self, xs: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return xs[0]


def turn_non_tensor() -> dict[str, Any]:
    """DualPipeV's turn (rank 1: virtual stage 1 hands on to 2 without p2p) checks what a
    stage passes as a link between ranks does."""
    from deepspeed_ext.runtime.pipe import DualPipeVModule, LayerSpec

    layers = [
        LayerSpec(nn.Linear, pr.DIM, pr.DIM),
        LayerSpec(_WithNone),
        LayerSpec(_First),
        LayerSpec(nn.Linear, pr.DIM, pr.DIM),
    ]
    module = DualPipeVModule(
        layers, num_stages=2, loss_fn=nn.functional.mse_loss, partition_method=[0, 1, 2, 3, 4]
    )
    engine = _engine(module, gas=4)
    data = [(torch.randn(pr.MICRO, pr.DIM), torch.randn(pr.MICRO, pr.DIM)) for _ in range(4)]
    return _expect_failure(lambda: engine.train_batch(iter(data) if engine._needs_data() else None))


def missing_loss_fn() -> dict[str, Any]:
    engine = _engine(_module(loss_fn=None))
    return _expect_failure(lambda: _train(engine, 1))


def detached_stage() -> dict[str, Any]:
    """Reentrant checkpointing of the embedding: stage 0's output needs no gradient."""
    engine = _engine(
        _module(activation_checkpoint_interval=1, activation_checkpoint_func=_reentrant)
    )
    return _expect_failure(lambda: _train(engine, 1))


def eval_data_runs_out() -> dict[str, Any]:
    """An eval iterator with 1 micro-batch for 2 (an eval loop's end): StopIteration on
    every stage before any p2p, and training goes on exactly as without that call."""
    engine, plain = _engine(_module()), _engine(_module())
    _train(engine, 1)
    out = _expect_failure(lambda: engine.eval_batch(iter(pr.batches(5, 0, 1))))
    it = iter(pr.batches(1, 0, 2)) if engine._needs_data() else None
    after = float(engine.train_batch(it))
    return {"eval": out, "after": after, "plain": _train(plain, 2)[1]}


def failed_batch_then_more() -> dict[str, Any]:
    """A batch that fails mid-schedule (the last stage's loss rejects micro-batch 1's
    labels): the batch fails on both stages; the engine then refuses further batches (that
    batch's messages may still be in flight) instead of reading them as the next batch's,
    on every stage."""
    engine = _engine(_module())
    _train(engine, 1)
    good, (ids, labels) = pr.batches(5, 0, 2)
    bad = [good, (ids, labels[:, :-1])]  # a label short: cross-entropy's shapes disagree
    first = _expect_failure(lambda: engine.train_batch(iter(bad) if engine._needs_data() else None))
    then = _expect_failure(lambda: _train(engine, 1))
    again = _expect_failure(lambda: engine.eval_batch(iter(bad[:1]), num_micro_batches=1))
    return {"first": first, "then": then, "again": again}


def train_data_runs_out() -> dict[str, Any]:
    """Training data running out (1 micro-batch for 2 on the first stage, then on the last,
    then set_dataloader's one pass of 4 micro-batches): StopIteration on every stage before
    any p2p, and training goes on with new data exactly as an engine that never ran out
    (with dropout on the first stage: its stopped forward's seed_layers count put back)."""
    from torch import nn

    from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule

    layers = pr.specs()
    layers.insert(2, LayerSpec(nn.Dropout, 0.2))
    args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
    engine, plain = (_engine(PipelineModule(layers, **args)) for _ in range(2))
    _train(engine, 1)
    # the first stage runs out, the last stage has both micro-batches (and drops them)
    gas = 1 if engine.is_first_stage() else 2
    short = _expect_failure(
        lambda: engine.train_batch(iter(pr.batches(7, 0, gas)) if engine._needs_data() else None)
    )
    # the last stage runs out: the first has forwarded its first micro-batch meanwhile
    gas = 2 if engine.is_first_stage() else 1
    short_last = _expect_failure(
        lambda: engine.train_batch(iter(pr.batches(7, 0, gas)) if engine._needs_data() else None)
    )
    after = float(engine.train_batch(iter(pr.batches(1, 0, 2)) if engine._needs_data() else None))
    engine.set_dataloader(pr.batches(2, 0, 2) + pr.batches(3, 0, 2))
    passed = [float(engine.train_batch()) for _ in range(2)]
    end = _expect_failure(engine.train_batch)
    got = [after, *passed]
    return {
        "short": short,
        "short_last": short_last,
        "end": end,
        "got": got,
        "plain": _train(plain, 4)[1:],
    }


class _TokenNorm(nn.Module):
    """BatchNorm over the feature dim of (batch, seq, dim) activations: running stats."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def stopped_batch_undone() -> dict[str, Any]:
    """Without seed_layers, dropout draws from the global random stream, and a BatchNorm
    keeps running stats: a batch stopped after the first stage forwarded (the last stage's
    data ran out) leaves both as they were, so training goes on as an engine that never
    ran out, random draws and statistics included."""
    from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule

    layers = pr.specs()
    layers[1:1] = [LayerSpec(_TokenNorm, pr.DIM), LayerSpec(nn.Dropout, 0.2)]
    args = dict(num_stages=2, loss_fn=pr.lm_loss, partition_method="uniform")

    def run(stop: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(3)  # the same weights for both engines
        engine = _engine(PipelineModule(layers, **args))
        torch.manual_seed(7)  # ... and the same dropout masks
        losses = _train(engine, 1)
        error = None
        if stop:
            gas = 2 if engine.is_first_stage() else 1
            it = iter(pr.batches(7, 0, gas)) if engine._needs_data() else None
            error = _expect_failure(lambda: engine.train_batch(it))["error"]
            assert error == "StopIteration", error
        losses += [
            float(engine.train_batch(iter(pr.batches(s, 0, 2)) if engine._needs_data() else None))
            for s in (1, 2)
        ]
        stats = [
            b.clone()
            for m in engine.module.modules()
            if isinstance(m, nn.BatchNorm1d)
            for b in (m.running_mean, m.running_var)
        ]
        return losses, stats

    (got, stats), (plain, plain_stats) = run(True), run(False)
    return {
        "got": got,
        "plain": plain,
        "stats": len(stats),
        "stats_equal": all(torch.equal(a, b) for a, b in zip(stats, plain_stats)),
    }


def tied_groups() -> dict[str, Any]:
    """get_tied_weights_and_groups(): the embedding tied across both stages, with a torch
    process group of the two that a gradient can be summed over; upstream's tied_comms and
    _synchronize_tied_weights."""
    import torch.distributed as dist

    engine = _engine(_module())
    out = []
    for p, group in engine.module.get_tied_weights_and_groups():
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        out.append((list(p.shape), dist.get_world_size(group), float(t)))
    # upstream's tied_comms index, and _synchronize_tied_weights after a hand-made change
    comms = {
        k: (d["ranks"], d["weight_attr"], d["module"] is engine.module.tied_modules[k])
        for k, d in engine.module.tied_comms.items()
    }
    weight = engine.module.tied_modules["embed"].weight
    with torch.no_grad():
        weight.add_(float(engine.stage_id))  # stage 1's copy drifts
        engine.module._synchronize_tied_weights()
        ref = weight.detach().clone()
        dist.all_reduce(ref, group=engine.module.tied_comms["embed"]["group"])
    return {"tied": out, "comms": comms, "synced": torch.equal(ref, 2 * weight.detach())}


def stage_p2p() -> dict[str, Any]:
    """Upstream's deepspeed.runtime.pipe.p2p between the two stages: a tensor each way, an
    async receive, an object, and a stage that is no neighbour refused."""
    from deepspeed.runtime.pipe import p2p
    from deepspeed_ext.comm import collective_device

    engine = _engine(_module())
    p2p.init_process_groups(engine.grid)
    me, dev = engine.stage_id, collective_device()
    other = 1 - me
    got = torch.zeros(3, device=dev)
    if me == 0:
        p2p.send(torch.arange(3.0, device=dev), other)
        p2p.recv(got, other, async_op=True)
        p2p.wait()
        p2p.send_obj({"from": 0, "shape": [2, 3]}, other)
        obj = None
    else:
        p2p.recv(got, other)
        p2p.send(got * 10, other)
        obj = p2p.recv_obj(other)
    try:
        p2p.send(got, me)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"got": got.tolist(), "obj": obj, "refused": refused, "can": p2p.can_send_recv()}


def frozen_first_stage(stage: int = 1, client_object: bool = False) -> dict[str, Any]:
    """Stage 0's layers frozen (fine-tuning the rest): its rank has nothing to train, and
    nothing it sends needs a gradient; ZeRO `stage`, the config's optimizer, or a torch
    optimizer object built on every param (frozen ones too, as upstream takes it)."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule

    args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
    module = PipelineModule(pr.specs(tied=False), **args)
    if module.stage_id == 0:
        module.requires_grad_(False)
    before = [p.detach().clone() for p in module.parameters()]
    if client_object:
        cfg = {
            "train_micro_batch_size_per_gpu": pr.MICRO,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": pr.CLIP,
            "zero_optimization": {"stage": stage},
        }
        opt = torch.optim.AdamW(module.parameters(), lr=pr.LR)
        engine, *_ = initialize(model=module, config=cfg, optimizer=opt)
    else:
        adamw = {"type": "AdamW", "params": {"lr": pr.LR, "weight_decay": 0.01}}  # torch's
        engine = _engine(module, optimizer=adamw, zero_optimization={"stage": stage})
    losses = _train(engine, 3)
    moved = [not torch.equal(a, b) for a, b in zip(before, engine.module.parameters())]
    return {"losses": losses, "frozen_layers": module.parts[1], "moved": moved}


def client_groups_tied() -> dict[str, Any]:
    """A torch optimizer object with two param groups (weight decay on the matrices) and a
    torch scheduler built on it before initialize, the embedding tied across the stages
    (as Megatron-DeepSpeed passes its own), at ZeRO 1 and 2: the tied weights' group, split
    off its source group, follows its lr; a key spread over two groups is refused."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule

    out: dict[str, Any] = {}
    args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
    for stage in (1, 2):
        module = PipelineModule(pr.specs(), **args)
        opt, sched = pr.decay_groups(module)
        cfg = {
            "train_micro_batch_size_per_gpu": pr.MICRO,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": pr.CLIP,
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = initialize(model=module, config=cfg, optimizer=opt, lr_scheduler=sched)
        out[f"zero{stage}"] = _train(engine, 3)
        out[f"lrs{stage}"] = [g["lr"] for g in engine.optimizer.param_groups]
    from deepspeed_ext.runtime.pipe import TiedLayerSpec

    class BiasedEmbed(pr.Embed):  # a second tied weight, 1-D: the other group
        def __init__(self, vocab: int, dim: int) -> None:
            super().__init__(vocab, dim)
            self.bias = torch.nn.Parameter(torch.zeros(dim))

    layers = pr.specs()
    attrs = ["weight", "bias"]
    layers[0] = TiedLayerSpec("embed", BiasedEmbed, pr.VOCAB, pr.DIM, tied_weight_attr=attrs)
    layers[-1] = TiedLayerSpec(
        "embed", BiasedEmbed, pr.VOCAB, pr.DIM, forward_fn=pr.project, tied_weight_attr=attrs
    )
    module = PipelineModule(layers, **args)
    opt, _ = pr.decay_groups(module)
    out["spread"] = _expect_failure(lambda: initialize(model=module, config=cfg, optimizer=opt))
    return out


def tied_frozen() -> dict[str, Any]:
    """A tied embedding frozen on stage 0 only is refused at start on both stages (its
    copies would drift apart); frozen on both, the rest trains."""
    from deepspeed_ext.runtime.pipe import PipelineModule

    args = dict(num_stages=2, loss_fn=pr.lm_loss, seed_layers=True, partition_method="uniform")
    one = PipelineModule(pr.specs(), **args)
    if one.stage_id == 0:
        one.tied_modules["embed"].requires_grad_(False)
    refused = _expect_failure(lambda: _engine(one))
    both = PipelineModule(pr.specs(), **args)
    both.tied_modules["embed"].requires_grad_(False)
    return {"refused": refused, "losses": _train(_engine(both), 3)}


class _Detach(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


def gradient_cut() -> dict[str, Any]:
    """Interleaved, virtual stage 1 (rank 1) a parameter-free layer that detaches its
    input, whose gradient the trained virtual stage 0 needs: an error naming the stage,
    where sending back nothing would train stage 0 on no gradient, silently."""
    from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule

    specs = pr.specs(tied=False)
    layers = [*specs[:2], LayerSpec(_Detach), *specs[2:]]
    module = PipelineModule(
        layers, num_stages=2, loss_fn=pr.lm_loss, partition_method=[0, 2, 3, 5, 8], virtual_stages=2
    )
    return _expect_failure(lambda: _train(_engine(module), 1))


SCENARIOS = {
    "eval": eval_after_training,
    "stage_p2p": stage_p2p,
    "tied_groups": tied_groups,
    "interleaved": interleaved,
    "dualpipev": dualpipev,
    "checkpointed": checkpointed,
    "timed": timed,
    "fp16": fp16,
    "fp16_overflow": lambda: fp16(30),
    "zb_fp16": lambda: fp16(8, pipeline={"schedule": "zb-h1"}),
    "zb_checkpointed": zero_bubble,
    "zb_reentrant": lambda: zero_bubble(_reentrant),
    "zb_reentrant_ours": lambda: zero_bubble(_ours_reentrant),
    "turn_non_tensor": turn_non_tensor,
    "interleaved_odd_gas": lambda: _expect_failure(
        lambda: _engine(_module(virtual_stages=2), gas=3)
    ),
    "config_key": config_key,
    "dynamic": dynamic_shapes,
    "reset_shapes": reset_shapes,
    "shape_change": shape_change,
    "missing_iterator": missing_iterator,
    "iterator_lost_later": iterator_lost_later,
    "missing_loss_fn": missing_loss_fn,
    "detached_stage": detached_stage,
    "eval_runs_out": eval_data_runs_out,
    "train_runs_out": train_data_runs_out,
    "stopped_undone": stopped_batch_undone,
    "client_groups_tied": client_groups_tied,
    "frozen_first_stage": frozen_first_stage,
    "frozen_client_object": lambda: frozen_first_stage(2, client_object=True),
    "tied_frozen": tied_frozen,
    "gradient_cut": gradient_cut,
    "failed_batch": failed_batch_then_more,
}


def run_all() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - one broken scenario must not hide the others
            out[name] = {"crashed": traceback.format_exc()}
            break  # the ranks may disagree about where they are: stop here
    return out

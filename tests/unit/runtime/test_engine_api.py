"""deepspeed.initialize and the engine's API around the training step."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.runtime.models import batch, loss_fn, mlp


def _dataloader_shards(n: int) -> list[int]:
    from deepspeed_ext.runtime.initialize import initialize

    data = torch.utils.data.TensorDataset(torch.arange(n).float().unsqueeze(1))
    engine, _, loader, _ = initialize(
        model=torch.nn.Linear(1, 1),
        training_data=data,
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    seen = [int(v) for (xb,) in loader for v in xb.flatten()]
    assert all(len(xb) <= 4 for (xb,) in loader)
    return seen


def test_training_data_is_sharded_across_ranks():
    a, b = run_ranks(_dataloader_shards, 2, 20)
    assert not set(a) & set(b), "ranks must see disjoint samples"
    assert sorted(a + b) == list(range(20))


def _client_objects() -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, eopt, _, sched = initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config={"train_micro_batch_size_per_gpu": 8},
    )
    x, y = batch(0, 0)
    engine.backward(loss_fn(engine, x, y))
    engine.step()
    engine2, eopt2, _, _ = initialize(
        model=mlp(),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 8},
    )
    # a factory gets a flat iterable of params when params were given flat (upstream calls it
    # with model_parameters), groups when groups were given
    seen: dict[str, object] = {}

    def factory(params):
        params = list(params)
        seen.setdefault("kinds", []).append(type(params[0]).__name__)  # type: ignore[union-attr]
        return torch.optim.SGD([p for p in params if not isinstance(p, dict)] or params, lr=0.1)

    for stage in (0, 2):
        for given in (None, "groups"):
            model = mlp()
            groups = [{"params": list(model.parameters()), "lr": 0.1}] if given else None
            initialize(
                model=model,
                model_parameters=groups,
                optimizer=factory,
                config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}},
            )
    return {
        "same_opt": eopt is opt,
        "lr_after": engine.get_lr()[0],
        "sched": type(sched).__name__,
        "callable_opt": type(eopt2).__name__,
        "factory_got": seen["kinds"],
    }


def test_client_optimizer_and_callables():
    (r,) = run_ranks(_client_objects, 1)
    assert r["same_opt"] and r["sched"] == "StepLR" and r["lr_after"] == 0.25
    assert r["callable_opt"] == "Adam"
    got = r["factory_got"]  # stages 0 and 2: params given flat, then as groups
    assert [k == "dict" for k in got] == [False, True, False, True], got


def _init_error(cfg: dict) -> str:
    from deepspeed_ext.runtime.initialize import initialize

    try:
        initialize(model=mlp(), config=cfg)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "cfg,expect",
    [
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, "stage"),
        (
            {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "adamm"}},
            "Did you mean 'adam",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "adamw", "params": {"lrr": 1}},
            },
            "lrr",
        ),
        ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabeld": True}}, "fp16.enabeld"),
    ],
)
def test_bad_config_fails_at_initialize_naming_the_key(cfg, expect):
    (msg,) = run_ranks(_init_error, 1, cfg)
    assert expect in msg, msg


def _passthrough_and_counters() -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    model = mlp()
    model.custom_attribute = 41
    engine, *_ = initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    boundaries = []
    for m in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        x, y = batch(m, 0)
        engine.backward(loss_fn(engine, x, y))
        engine.step()
    engine.set_gradient_accumulation_boundary(True)
    forced = engine.is_gradient_accumulation_boundary()
    return {
        "attr": engine.custom_attribute,
        "boundaries": boundaries,
        "forced": forced,
        "steps": engine.global_steps,
        "samples": engine.global_samples,
        "tbs": engine.train_batch_size(),
    }


def test_module_passthrough_and_step_counters():
    (r,) = run_ranks(_passthrough_and_counters, 1)
    assert r["attr"] == 41
    assert r["boundaries"] == [False, False, True, False, False, True]
    assert r["forced"] and r["steps"] == 2 and r["samples"] == 48 and r["tbs"] == 24


def _events(out: str) -> None:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(
        model=mlp(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "jsonl_monitor": {"enabled": True, "output_path": out, "job_name": "run"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"},
        },
    )
    assert engine.monitor.enabled
    engine.monitor.write_events([("Eval/accuracy", 0.5, 10), ("Eval/accuracy", 0.75, 20)])
    engine.destroy()


def test_engine_monitor_writes_a_users_own_events(tmp_path):
    """Upstream's engine.monitor.write_events (Megatron-style evaluation logging) was
    missing: an AttributeError."""
    run_ranks(_events, 1, str(tmp_path))
    events = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert [json.loads(e) for e in events] == [
        {"tag": "Eval/accuracy", "value": 0.5, "step": 10},
        {"tag": "Eval/accuracy", "value": 0.75, "step": 20},
    ]
    rows = (tmp_path / "run" / "Eval_accuracy.csv").read_text().splitlines()
    assert rows == ["step,accuracy", "10,0.5", "20,0.75"]


def _monitored(out: str, printed: bool = True) -> list[float]:
    """Each rank's own losses, for the line's data-parallel mean. printed=False: a csv
    monitor alone (its writer on rank 0 only), no steps_per_print."""
    from deepspeed_ext.comm import get_rank
    from deepspeed_ext.runtime.initialize import initialize

    config: dict = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"},
    }
    if printed:
        config["steps_per_print"] = 2
        config["jsonl_monitor"] = {"enabled": True, "output_path": out, "job_name": "run"}
    engine, *_ = initialize(model=mlp(), config=config)
    losses = []
    for s in range(4):
        x, y = batch(s, get_rank())
        loss = loss_fn(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.destroy()
    return losses


def test_the_lines_loss_is_the_mean_over_the_data_parallel_ranks(tmp_path):
    """Upstream logs rank 0's own; the line here is every rank's batches' mean."""
    per_rank = run_ranks(_monitored, 2, str(tmp_path))
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row, window in zip(rows, (slice(0, 2), slice(2, 4))):
        want = sum(sum(r[window]) for r in per_rank) / 4
        assert row["loss"] == pytest.approx(want, rel=1e-6), (row, per_rank)
        assert row["loss"] != pytest.approx(sum(per_rank[0][window]) / 2, rel=1e-6)


def test_a_monitor_on_rank_0_alone_keeps_the_ranks_in_step(tmp_path):
    """Every rank reaches the loss's all-reduce, though only rank 0 writes (it was rank 0
    alone: its all-reduce met the others' gradient buckets)."""
    per_rank = run_ranks(_monitored, 2, str(tmp_path), False, timeout=120)
    rows = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()[1:]
    for step, row in enumerate(rows):
        want = (per_rank[0][step] + per_rank[1][step]) / 2
        assert float(row.split(",")[1]) == pytest.approx(want, rel=1e-6), (rows, per_rank)


def test_monitors_write_the_metrics_line_values(tmp_path, capfd):
    run_ranks(_monitored, 1, str(tmp_path))
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for key in ("loss", "lr", "samples_per_s", "peak_mem_gib", "grad_norm"):
        assert key in rows[0], rows[0]
    # upstream's csv_monitor layout: a file per tag, the sample count in the step column
    csv_lines = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert csv_lines == ["step,train_loss", *(f"{16 * (i + 1)},{rows[i]['loss']}" for i in (0, 1))]
    assert (tmp_path / "run" / "Train_Samples_lr.csv").exists()
    err = capfd.readouterr().err
    assert "step 2 | loss" in err and "samples/s" in err and "peak mem" in err


def _breakdown() -> None:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(
        model=mlp(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "steps_per_print": 2,
            "wall_clock_breakdown": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    for s in range(2):
        x, y = batch(s, 0)
        engine.backward(loss_fn(engine, x, y))
        engine.step()


def test_wall_clock_breakdown_adds_phase_times(capfd):
    run_ranks(_breakdown, 1)
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if "step 2 |" in ln)
    assert "forward" in line and "backward" in line and " step " in line.split("peak mem")[1], line


class _DictIn(torch.nn.Module):
    """Takes its batch as a dict of sequence-first token ids ([seq, batch])."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.embed(batch["ids"]).pow(2).mean()


def _counted() -> dict:
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(
        model=_DictIn(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 1,
            "memory_breakdown": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    ids = torch.randint(0, 50, (12, 4))  # 12 tokens of 4 sequences
    engine.backward(engine({"ids": ids}))
    trained = engine.metrics.mark()
    engine.eval()
    with torch.no_grad():
        for _ in range(5):
            engine({"ids": ids})
    evaluated = engine.metrics.mark()
    engine.train()
    engine.step()
    return {"trained": trained, "evaluated": evaluated, "last": engine.metrics.last}


def test_throughput_counts_trained_micro_batches_and_the_peak_survives_the_breakdown():
    """samples/s took the first tensor's first dimension: 0 for a dict batch, the sequence
    length for sequence-first ids, and evaluation forwards counted as trained samples. And
    memory_breakdown's per-phase resets left the line's peak at the step's alone."""
    (r,) = run_ranks(_counted, 1)
    assert r["trained"] == (4, 48) and r["evaluated"] == (4, 48)
    last = r["last"]
    phase_peaks = [v for k, v in last.items() if k.endswith("_peak_mb")]
    assert len(phase_peaks) == 3, last
    assert last["peak_mem_gib"] * 1024 >= max(phase_peaks) - 1e-6, last


def _resumed_windows(out: str) -> list:
    from deepspeed_ext.runtime.initialize import initialize

    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "jsonl_monitor": {"enabled": True, "output_path": out, "job_name": "run"},
    }
    engine, *_ = initialize(model=mlp(), config=cfg)
    for s in range(3):
        x, y = batch(s, 0)
        engine.backward(loss_fn(engine, x, y))
        engine.step()
    engine.save_checkpoint(f"{out}/ckpt", tag="t1")
    engine.destroy()
    cfg["jsonl_monitor"]["job_name"] = "resumed"
    engine, *_ = initialize(model=mlp(), config=cfg)  # as after a restart
    engine.load_checkpoint(f"{out}/ckpt", tag="t1")
    x, y = batch(3, 0)
    engine.backward(loss_fn(engine, x, y))
    engine.step()
    engine.destroy()
    lines = (Path(out) / "resumed" / "ranks" / "rank0.jsonl").read_text().splitlines()
    return [(r["step"], r["steps"]) for r in map(json.loads, lines)]


def test_a_resumed_run_counts_its_next_window_from_the_checkpoint(tmp_path):
    (windows,) = run_ranks(_resumed_windows, 1, str(tmp_path))
    assert windows == [(4, 1)], windows  # it was (4, 4): the window counted from step 0


def _unread_breakdown() -> dict:
    import deepspeed_ext.utils.logging as log
    from deepspeed_ext.runtime.initialize import initialize

    warned: list[str] = []
    log.logger.warning = lambda msg, *a, **k: warned.append(str(msg))  # type: ignore[method-assign]
    base = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "SGD", "params": {"lr": 1}}}
    said = []
    for extra in ({"wall_clock_breakdown": True}, {"memory_breakdown": True, "steps_per_print": 5}):
        warned.clear()
        initialize(model=mlp(), config={**base, **extra})
        said.append([w for w in warned if "nothing shows them" in w])
    engine, *_ = initialize(model=mlp(), config={**base, "flops_profiler": {"enabled": True}})
    warned.clear()
    initialize(model=mlp(), config={**base, "steps_per_print": 1, "log_level": "warning"})
    hidden = [w for w in warned if "hides the metrics line" in w]
    return {"said": said, "wall_clock": engine.wall_clock_breakdown(), "hidden": hidden}


def test_a_breakdown_nothing_shows_is_said_and_the_profiler_turns_it_on():
    (r,) = run_ranks(_unread_breakdown, 1)
    assert len(r["said"][0]) == 1 and "wall_clock_breakdown is on" in r["said"][0][0]
    assert r["said"][1] == []  # the metrics line shows it
    assert r["wall_clock"] is True  # upstream's: the FLOPs profiler times the phases
    # steps_per_print with a log_level that hides the line (an info record) is said
    assert len(r["hidden"]) == 1 and "log_level 'warning'" in r["hidden"][0], r["hidden"]


def _frozen_model(stage: int) -> dict:
    import deepspeed_ext.utils.logging as log
    from deepspeed_ext.runtime.initialize import initialize

    warned: list[str] = []
    log.logger.warning = lambda msg, *a, **k: warned.append(str(msg))  # type: ignore[method-assign]
    model = mlp().requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, opt, *_ = initialize(model=model, config=cfg)
    x, _ = batch(0, 0)
    with torch.no_grad():
        out = engine(x)
    engine.step()
    with (
        torch.no_grad(),
        __import__("deepspeed").zero.GatheredParameters(list(engine.module.parameters())),
    ):
        same = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return {
        "groups": [len(g["params"]) for g in opt.param_groups],
        "lr": opt.param_groups[0]["lr"],
        "shape": list(out.shape),
        "same": same,
        "warned": any("no parameter of the model requires a gradient" in w for w in warned),
    }


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_model_with_an_optimizer_runs_and_says_it_trains_nothing(stage):
    """Every parameter frozen and an optimizer section (a reference model built from the
    training config, as TRL's prepare_deepspeed builds one): it builds, runs its forward,
    steps nothing, and says so once; it failed with torch's "empty parameter list"."""
    (r,) = run_ranks(_frozen_model, 1, stage)
    assert r["groups"] == [0] and r["lr"] == 1e-3, r
    assert r["shape"][0] == 8 and r["same"] and r["warned"], r


def _lora_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Hugging Face's optimizer over a model whose first layer is frozen (a LoRA base), built
    on every param: a group of frozen params only, then decay and no-decay groups."""
    model[0].requires_grad_(False)
    params = list(model.parameters())
    train = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if not p.requires_grad]},
            {"params": [p for p in train if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in train if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _client_groups_run(stage: int, root: str) -> dict:
    """2 ranks; 3 steps, the third also after a save at step 2 and a resume."""
    import torch.distributed as dist

    from deepspeed_ext.runtime.initialize import initialize

    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}}

    def engine() -> tuple:
        model = mlp()
        eng, opt, *_ = initialize(model=model, config=cfg, optimizer=_lora_groups(model))
        return eng, opt

    def step(eng: object, s: int) -> float:
        x, y = batch(s, dist.get_rank())
        loss = loss_fn(eng, x, y)
        eng.backward(loss)
        eng.step()
        return float(loss)

    first, opt = engine()
    losses = [step(first, s) for s in range(2)]
    first.save_checkpoint(root, tag="t")
    losses.append(step(first, 2))
    again, _ = engine()
    again.load_checkpoint(root, tag="t")
    return {
        "losses": losses,
        "resumed": step(again, 2),
        "groups": [len(g["params"]) > 0 for g in opt.param_groups],
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_client_optimizer_with_a_frozen_group_trains_and_resumes(stage, tmp_path):
    """A group of frozen params only in a client optimizer is left empty (ZeRO 3 refused
    it), the other groups keep their options: losses as torch's on the same groups, and a
    resume continues exactly."""
    out = run_ranks(_client_groups_run, 2, stage, str(tmp_path))
    model = mlp()
    opt = _lora_groups(model)
    ref = []
    for s in range(3):
        opt.zero_grad()
        total = sum(loss_fn(model, *batch(s, r)) for r in range(2)) / 2
        total.backward()
        opt.step()
        ref.append(float(total.detach()))
    for r in out:
        assert r["groups"] == [False, True, True], r
        assert r["resumed"] == r["losses"][2], r
    mean = [sum(r["losses"][s] for r in out) / 2 for s in range(3)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref), rtol=1e-5, atol=1e-6)


class _Sched(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optimizer) -> None:
        super().__init__(optimizer, lambda s: 0.5)


def _surface_checks(tmp: str) -> dict:
    import argparse

    from deepspeed_ext.runtime.initialize import initialize

    out: dict = {}
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    data = [(torch.randn(4), torch.randn(2)) for _ in range(8)]
    seen: list = []

    def collate(batch):
        seen.append(len(batch))
        return torch.utils.data.default_collate(batch)

    model = torch.nn.Linear(4, 2)
    engine, _, loader, sched = initialize(
        model=model,
        model_parameters=model.named_parameters(),  # pairs: they crashed
        config={**base, "gradient_accumulation_steps": 2},
        training_data=data,
        collate_fn=collate,
        lr_scheduler=_Sched,  # a scheduler class is a factory
    )
    out["sched"] = isinstance(sched, _Sched) and engine.get_lr() == [0.05]
    out["loader_attrs"] = (
        loader.batch_size,
        loader.dataset is data,
        loader.collate_fn is collate,
        len(iter(loader)) == len(loader) == 4,
    )
    loader.data_sampler.set_epoch(3)  # upstream's per-epoch pattern
    # a peek does not move the epoch; a full pass does
    next(iter(loader))
    out["epochs"] = [loader.epoch]
    for _ in loader:
        pass
    out["epochs"].append(loader.epoch)
    seen.clear()
    evals = engine.deepspeed_io(data, route="eval", pin_memory=True, num_local_io_workers=0)
    next(iter(evals))
    out["collate_reused"] = seen == [2]
    # global_samples: a batch per optimizer step, as the Trainer's boundary-only step() counts
    x, y = data[0]
    counts = []
    for boundary in (False, True, False, True):
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(torch.nn.functional.mse_loss(engine(x[None]), y[None]))
        if boundary:
            engine.step()
        counts.append(engine.global_samples)
    out["samples"] = counts
    # a non-scalar loss is refused before anything is recorded; training goes on
    try:
        engine.backward(engine(x[None]))
    except TypeError as e:
        out["nonscalar"] = str(e)
    out["pending"] = engine._pending_backwards
    # step() inside no_sync, and no_sync inside no_sync, are refused
    try:
        with engine.no_sync():
            engine.step()
    except RuntimeError as e:
        out["no_sync_step"] = str(e)
    try:
        with engine.no_sync(), engine.no_sync():
            pass
    except RuntimeError as e:
        out["no_sync_nested"] = str(e)
    # --deepscale_config, upstream's old flag
    path = Path(tmp) / "ds.json"
    path.write_text(json.dumps(base))
    args = argparse.Namespace(deepspeed_config=None, deepscale_config=str(path))
    e2, *_ = initialize(args=args, model=torch.nn.Linear(4, 2))
    out["deepscale"] = e2.train_micro_batch_size_per_gpu()
    return out


def test_upstreams_engine_surface_for_data_schedulers_and_counts(tmp_path):
    """From a fuzzing helper's side-by-side runs with upstream 0.19.8."""
    (r,) = run_ranks(_surface_checks, 1, str(tmp_path))
    assert r["sched"]
    assert r["loader_attrs"] == (2, True, True, True)
    assert r["epochs"] == [3, 4], r["epochs"]  # the caller's set_epoch(3), then one pass
    assert r["collate_reused"]
    assert r["samples"] == [0, 4, 4, 8], r["samples"]
    assert "the loss must be a scalar tensor, not a tensor of shape (1, 2)" in r["nonscalar"]
    assert r["pending"] == 0
    assert "inside engine.no_sync()" in r["no_sync_step"]
    assert "does not nest" in r["no_sync_nested"]
    assert r["deepscale"] == 2

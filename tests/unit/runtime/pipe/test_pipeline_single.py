"""A one-stage pipeline (in one spawned rank, so this process never holds a process group):
the engine's API, and the config it refuses by name before any collective."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.errors import error_text

from . import pipe_runs as pr

REFUSED = {
    "zero3_param_offload": (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "offload_param needs zero_optimization.stage 3, which runs as stage 2",
    ),
    "stages": ({"pipeline": {"stages": 2}}, "pipeline.stages is 2"),
    "partition": ({"pipeline": {"partition": "uniform"}}, "pipeline.partition is 'uniform'"),
    "interval_off": (
        {"pipeline": {"activation_checkpoint_interval": 0}},
        "activation_checkpoint_interval is 0 but the PipelineModule was built with "
        "activation_checkpoint_interval=1",
    ),
    "seed": ({"pipeline": {"seed_layers": False}}, "pipeline.seed_layers"),
    "interval_negative": (
        {"pipeline": {"activation_checkpoint_interval": -1}},
        "pipeline.activation_checkpoint_interval",
    ),
    "schedule": ({"pipeline": {"schedule": "interleaved"}}, "virtual_stages=2"),
    "schedule_name": ({"pipeline": {"schedule": "zb-h2"}}, "zb-h1"),
    "dualpipev_on_plain": ({"pipeline": {"schedule": "dualpipev-zb"}}, "DualPipeVModule"),
}


# the module a REFUSED case builds, where not the default one
MODULE_ARGS = {"interval_off": {"activation_checkpoint_interval": 1}}


def _module(cls: Any = None, **kw: Any) -> Any:
    from deepspeed_ext.runtime.pipe import PipelineModule

    args: dict[str, Any] = dict(num_stages=1, loss_fn=pr.lm_loss, seed_layers=True)
    args.update(kw)
    return (cls or PipelineModule)(pr.specs(), **args)


def _config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": pr.MICRO, "gradient_accumulation_steps": 2, **extra}


def _adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=pr.LR)


def _own_layer_files(root: str) -> dict[str, Any]:
    """A subclass overriding upstream's layer-file hooks: its names, its extra file, its
    load (called with load_module_strict), and a resume that continues as the original."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import PipelineModule

    calls: list[Any] = []

    class OwnFiles(PipelineModule):
        def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
            return os.path.join(ckpt_dir, f"mine_{local_layer_idx}.pt")

        def save_state_dict(
            self, save_dir: str, checkpoint_engine: Any, exclude_frozen_params: bool = False
        ) -> None:
            super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
            checkpoint_engine.save({"note": torch.tensor(7)}, os.path.join(save_dir, "extra.pt"))

        def load_state_dir(
            self, load_dir: str, checkpoint_engine: Any, strict: bool = True
        ) -> None:
            extra = checkpoint_engine.load(os.path.join(load_dir, "extra.pt"))
            calls.append((strict, int(extra["note"])))
            super().load_state_dir(load_dir, checkpoint_engine, strict)

    first, *_ = initialize(model=_module(cls=OwnFiles), config=_config(), optimizer=_adamw)
    for s in range(2):
        first.train_batch(iter(pr.batches(s, 0, 2)))
    first.save_checkpoint(root, tag="t")
    cont = float(first.train_batch(iter(pr.batches(2, 0, 2))))
    other = _module(cls=OwnFiles, base_seed=99)  # other initial weights
    again, *_ = initialize(model=other, config=_config(), optimizer=_adamw)
    again.load_checkpoint(root, tag="t", load_module_strict=False)
    # the defaults called directly: save into a directory, load it into other weights; a
    # missing file and a file of other keys are errors naming the file
    plain, other_plain = _module(), _module(base_seed=99)
    where = os.path.join(root, "direct")
    plain.save_state_dict(where)
    other_plain.load_state_dir(where)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), other_plain.parameters()))
    missing = error_text(lambda: plain.load_state_dir(os.path.join(root, "t")))
    torch.save({"bogus": torch.zeros(1)}, plain.ckpt_layer_path(where, 0))
    misfit = error_text(lambda: plain.load_state_dir(where))
    return {
        "direct": (same, missing, misfit),
        "files": sorted(os.listdir(os.path.join(root, "t"))),
        "calls": calls,
        "continued": (cont, float(again.train_batch(iter(pr.batches(2, 0, 2))))),
    }


def _upstream_helpers(engine: Any) -> dict[str, Any]:
    """Upstream's print helpers: log_for_device is off until its module switches select this
    stage (set at upstream's import path); tput_log prints at steps_per_print steps."""
    import contextlib
    import io

    import deepspeed.runtime.pipe.engine as upstream_path

    def printed(fn: Any, *msg: Any) -> str:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            fn(*msg)
        return buf.getvalue()

    out = {"off": printed(engine.log_for_device, "hello")}
    upstream_path.LOG_STAGE, upstream_path.DATA_PARALLEL_ID = 0, -1
    try:
        out["on"] = printed(engine.log_for_device, "hello")
    finally:
        upstream_path.LOG_STAGE, upstream_path.DATA_PARALLEL_ID = -2, -2
    out["tput_unset"] = printed(engine.tput_log, "tput")  # steps_per_print unset: never
    engine.steps_per_print = lambda: 10
    steps = engine.global_steps
    out["tput_off"] = printed(engine.tput_log, "tput")  # 3 steps, printing every 10
    engine.global_steps = 10
    out["tput_on"] = printed(engine.tput_log, "tput")
    engine.global_steps = steps
    del engine.steps_per_print
    out["extra"] = engine.get_additional_losses() is engine.agg_additional_losses
    out["ids"] = engine.ID_TO_DTYPE[engine.DTYPE_TO_ID[torch.bfloat16]] is torch.bfloat16
    out["num_layers"] = engine.module._num_layers == len(pr.specs())  # upstream's attribute
    return out


def checks(root: str) -> dict[str, Any]:
    from deepspeed_ext.runtime.initialize import initialize

    out: dict[str, Any] = {}
    cfg = _config(gradient_clipping=pr.CLIP)
    engine, *_ = initialize(model=_module(), config=cfg, optimizer=_adamw)
    out["ends"] = (engine.is_first_stage(), engine.is_last_stage())
    out["losses"] = [float(engine.train_batch(iter(pr.batches(s, 0, 2)))) for s in range(3)]
    out["counters"] = (engine.global_steps, engine.micro_steps, engine.global_samples)
    out["helpers"] = _upstream_helpers(engine)
    out["forward"] = error_text(lambda: engine(torch.zeros(1)))
    out["step"] = error_text(engine.step)
    out["zero_micro_batches"] = error_text(
        lambda: engine.eval_batch(iter(pr.batches(0, 0, 2)), num_micro_batches=0)
    )

    data = [pr.micro_batch(0, 0, i) for i in range(3)]
    dataset = [(ids[0], labels[0]) for ids, labels in data]  # samples, batched by the loader
    fed, _, loader, _ = initialize(
        model=_module(), config=_config(), optimizer=_adamw, training_data=dataset
    )
    out["loader"] = loader is not None
    out["fed"] = [float(fed.train_batch()) for _ in range(3)]  # more than the loader holds
    # upstream's pipeline reads training_data in order: the same as an iterator over it
    ordered = [b for _ in range(3) for b in torch.utils.data.DataLoader(dataset, pr.MICRO)]
    by_hand, *_ = initialize(model=_module(), config=_config(), optimizer=_adamw)
    it = iter(ordered)
    out["fed_in_order"] = [float(by_hand.train_batch(it)) for _ in range(3)]

    bare, *_ = initialize(model=_module(), config=_config(), optimizer=_adamw)
    out["no_iterator"] = error_text(bare.train_batch)
    for name, (extra, _) in REFUSED.items():
        kw = MODULE_ARGS.get(name, {})
        out[name] = error_text(
            lambda extra=extra, kw=kw: initialize(
                model=_module(**kw), config=_config(**extra), optimizer=_adamw
            )
        )
    out["boundaries"] = _boundaries()
    out["unknown_instruction"] = _unknown_instruction()
    out["interval_from_config"] = _interval_from_config()
    out["megatron_pipes"] = _megatron_pipes()
    agree = _config(pipeline={"stages": 1, "partition": "best", "seed_layers": True})
    out["agree"] = error_text(lambda: initialize(model=_module(), config=agree, optimizer=_adamw))
    key = _config(pipeline_parallelism={"num_stages": 1})
    out["key_on_module"] = error_text(
        lambda: initialize(model=pr.Reference(), config=key, optimizer=_adamw)
    )
    out["mpu"] = error_text(
        lambda: initialize(model=_module(), config=_config(), optimizer=_adamw, mpu=object())
    )
    from deepspeed_ext.runtime.pipe import DualPipeVModule

    out["v_one_stage"] = error_text(lambda: _module(DualPipeVModule))
    out["v_chunks"] = error_text(lambda: _module(DualPipeVModule, num_stages=2, virtual_stages=3))
    out["v_few_layers"] = error_text(lambda: DualPipeVModule(pr.specs()[:3], 2))
    out["v_float"] = error_text(lambda: _module(num_stages=2, virtual_stages=2.0))
    out["v_bool"] = error_text(lambda: _module(num_stages=2, virtual_stages=True))
    out["seeded"] = _seeded_dropout()
    out["own_files"] = _own_layer_files(root)
    for name, returned in (("extra_list", [1.0]), ("extra_reserved", {"lr": 1.0})):
        odd = _module()
        odd.get_additional_losses = lambda returned=returned: returned  # type: ignore[method-assign]
        engine, *_ = initialize(model=odd, config=_config(), optimizer=_adamw)
        out[name] = error_text(lambda engine=engine: engine.train_batch(iter(pr.batches(0, 0, 2))))
    return out


def _unknown_instruction() -> tuple[str, float]:
    """A schedule with an instruction the engine does not run (one written for upstream's
    engine): refused before anything runs, and the engine trains on."""
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import schedule as sch

    class Unknown(sch.PipeInstruction):
        pass

    class Odd(sch.PipeSchedule):
        def steps(self) -> Any:
            yield [sch.LoadMicroBatch(0), Unknown()]

    engine, *_ = initialize(model=_module(), config=_config(), optimizer=_adamw)
    refused = error_text(lambda: engine._run(Odd(2, 1, 0)))
    return refused, float(engine.train_batch(iter(pr.batches(0, 0, 2))))


def _boundaries() -> dict[str, list[bool]]:
    """is_gradient_accumulation_boundary() as upstream's pipeline engine answers it: False
    in every micro-batch's forward and backward and between batches, True at the step."""
    from deepspeed_ext.runtime.initialize import initialize

    engine, *_ = initialize(model=_module(), config=_config(), optimizer=_adamw)
    seen: dict[str, list[bool]] = {"forward": [], "backward": [], "step": [], "between": []}
    layer = engine.module.forward_funcs[1]

    def asked(kind: str) -> Any:
        return lambda *_: seen[kind].append(engine.is_gradient_accumulation_boundary())

    layer.register_forward_hook(asked("forward"))
    layer.register_full_backward_hook(asked("backward"))
    engine.optimizer.register_step_pre_hook(asked("step"))
    for s in range(2):
        engine.train_batch(iter(pr.batches(s, 0, 2)))
        seen["between"].append(engine.is_gradient_accumulation_boundary())
    return seen


def _interval_from_config() -> dict[str, Any]:
    """pipeline.activation_checkpoint_interval sets a module built without one (as upstream):
    the checkpoint function then runs, and training matches the reference."""
    from deepspeed_ext.runtime.initialize import initialize

    config = _config(pipeline={"activation_checkpoint_interval": 1})
    engine, *_ = initialize(model=_module(), config=config, optimizer=_adamw)
    module, calls = engine.module, []
    inner = module.activation_checkpoint_func

    def counted(function: Any, *args: Any) -> Any:
        calls.append(1)
        return inner(function, *args)

    module.activation_checkpoint_func = counted
    losses = [float(engine.train_batch(iter(pr.batches(s, 0, 2)))) for s in range(2)]
    interval = module.activation_checkpoint_interval
    return {"interval": interval, "calls": len(calls), "losses": losses}


def _megatron_pipes() -> dict[str, Any]:
    """Megatron-DeepSpeed's GPTModelPipe / GPT2ModelPipe (by class name, as upstream):
    only their ParallelTransformerLayerPipe layers are checkpointed, unless the function is
    the non-reentrant one; GPT2ModelPipe turns has_attention_mask on."""
    from deepspeed_ext.runtime.activation_checkpointing import non_reentrant_checkpoint
    from deepspeed_ext.runtime.initialize import initialize
    from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule

    class ParallelTransformerLayerPipe(pr.Block):
        pass

    class GPTModelPipe(PipelineModule):
        pass

    class GPT2ModelPipe(PipelineModule):
        pass

    layers = [
        LayerSpec(ParallelTransformerLayerPipe, pr.DIM) if s.typename is pr.Block else s
        for s in pr.specs()
    ]

    def which(cls: Any, **kw: Any) -> list[bool]:
        m = cls(layers, num_stages=1, loss_fn=pr.lm_loss, activation_checkpoint_interval=1, **kw)
        return [m._is_checkpointable([f]) for f in m.forward_funcs]

    gpt2 = GPT2ModelPipe(layers, num_stages=1, loss_fn=pr.lm_loss, activation_checkpoint_interval=1)
    engine, *_ = initialize(model=gpt2, config=_config(), optimizer=_adamw)
    return {
        "gpt": which(GPTModelPipe),
        "gpt2": which(GPT2ModelPipe),
        "plain": which(PipelineModule),
        "gpt_non_reentrant": which(
            GPTModelPipe, activation_checkpoint_func=non_reentrant_checkpoint
        ),
        "gpt2_mask": engine.has_attention_mask,
        "gpt2_trains": float(engine.train_batch(iter(pr.batches(0, 0, 2)))),
    }


def _seeded_dropout() -> list[bool]:
    """seed_layers: layer i of the k-th forward draws from seed base_seed * (k + 1) + i."""
    from deepspeed_ext.runtime.pipe import PipelineModule

    module = PipelineModule(
        [torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)], num_stages=1, seed_layers=True, base_seed=7
    )
    x = torch.ones(8, 4)
    got = [module(x), module(x)]
    lin = module.forward_funcs[0]
    want = []
    for k in (1, 2):
        torch.manual_seed(7 * (k + 1) + 1)
        want.append(torch.nn.functional.dropout(lin(x), 0.5, training=True))
    return [torch.equal(g, w) for g, w in zip(got, want)] + [not torch.equal(*got)]


@pytest.fixture(scope="module")
def res(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(checks, 1, str(tmp_path_factory.mktemp("pipe_single")))[0]


def test_one_stage_matches_the_reference(res: dict[str, Any]) -> None:
    assert res["ends"] == (True, True)
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(pr.reference(3, 2, 1)["losses"])
    )
    assert res["counters"] == (3, 6, 3 * 2 * pr.MICRO)


def test_upstreams_engine_helpers(res: dict[str, Any]) -> None:
    h = res["helpers"]
    assert h["off"] == h["tput_off"] == h["tput_unset"] == ""
    assert h["on"].startswith("RANK=0 PIPE-ID=0 DATA-ID=0 STEP-ID=3 :: hello"), h["on"]
    assert h["tput_on"] == "tput\n"
    assert h["extra"] and h["ids"] and h["num_layers"]


def test_training_data_feeds_train_batch(res: dict[str, Any]) -> None:
    assert res["loader"]
    assert all(torch.isfinite(torch.tensor(res["fed"])))
    assert res["fed"] == res["fed_in_order"]


def test_eval_batch_refuses_zero_micro_batches(res: dict[str, Any]) -> None:
    assert "num_micro_batches=0" in res["zero_micro_batches"], res["zero_micro_batches"]


def test_micro_batch_api_is_refused(res: dict[str, Any]) -> None:
    assert res["forward"].startswith("PipelineError") and "train_batch" in res["forward"]
    assert res["step"].startswith("PipelineError")
    assert (
        res["no_iterator"].startswith("PipelineError") and "no data iterator" in res["no_iterator"]
    )


@pytest.mark.parametrize("name", list(REFUSED))
def test_config_disagreeing_with_the_module_is_refused(res: dict[str, Any], name: str) -> None:
    assert res[name].split(":")[0] in ("ValueError", "ConfigError"), res[name]
    assert REFUSED[name][1] in res[name], res[name]


def test_an_instruction_the_engine_does_not_run_is_refused_first(res: dict[str, Any]) -> None:
    refused, loss = res["unknown_instruction"]
    assert (
        refused.startswith("PipelineError") and "does not run instruction(s) ['Unknown']" in refused
    )
    assert torch.isfinite(torch.tensor(loss))


def test_gradient_accumulation_boundary_as_upstreams_pipeline(res: dict[str, Any]) -> None:
    got = res["boundaries"]
    assert got["forward"] == got["backward"] == [False] * 4, got  # 2 batches x 2 micro
    assert got["step"] == [True, True] and got["between"] == [False, False], got


def test_config_interval_turns_checkpointing_on(res: dict[str, Any]) -> None:
    got = res["interval_from_config"]
    assert got["interval"] == 1 and got["calls"] > 0, got
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(pr.reference(2, 2, 1)["losses"])
    )


def test_megatron_gpt_pipes_checkpoint_their_transformer_layers_only(res: dict) -> None:
    got = res["megatron_pipes"]
    blocks = [False] + [True] * pr.BLOCKS + [False, False]  # embedding, blocks, norm, head
    assert got["gpt"] == got["gpt2"] == blocks, got
    # the plain rule: layers holding parameters (the tied head is its forward_fn, a function)
    assert got["plain"] == got["gpt_non_reentrant"] == [True] * (pr.BLOCKS + 2) + [False], got
    assert got["gpt2_mask"] is True
    assert torch.isfinite(torch.tensor(got["gpt2_trains"]))


def test_use_reentrant_false_with_partitioned_activations_is_refused() -> None:
    from types import SimpleNamespace

    from deepspeed_ext.runtime.pipe import checks
    from deepspeed_ext.runtime.pipe.module import DEFAULT_CHECKPOINTS

    module: Any = SimpleNamespace(activation_checkpoint_func=DEFAULT_CHECKPOINTS[None])
    with pytest.raises(ValueError, match="use_reentrant is false but activation_checkpointing"):
        checks._use_reentrant(False, module, SimpleNamespace(partition_activations=True))
    checks._use_reentrant(False, module, SimpleNamespace(partition_activations=False))
    assert module.activation_checkpoint_func is DEFAULT_CHECKPOINTS[False]
    checks._use_reentrant(True, module, SimpleNamespace(partition_activations=True))
    assert module.activation_checkpoint_func is DEFAULT_CHECKPOINTS[True]


def test_dualpipev_module_refuses_one_stage_and_other_chunk_counts(res: dict[str, Any]) -> None:
    assert "DualPipeVModule with 2 model chunks" in res["v_one_stage"], res["v_one_stage"]
    assert "num_stages >= 2" in res["v_one_stage"]
    assert "virtual_stages=3" in res["v_chunks"] and "exactly two" in res["v_chunks"]
    assert "has 3 layers: use at most 1 stages" in res["v_few_layers"], res["v_few_layers"]
    for kind in ("v_float", "v_bool"):  # not taken as a number of chunks
        assert "virtual_stages=" in res[kind] and "give an int" in res[kind], res[kind]


def test_config_agreeing_with_the_module_is_fine(res: dict[str, Any]) -> None:
    assert res["agree"] == "no error"


def test_config_key_refuses_a_model_it_cannot_cut(res: dict[str, Any]) -> None:
    assert "torch.nn.Sequential or a list of layers" in res["key_on_module"]


def test_mpu_beside_a_pipeline_module_is_refused(res: dict[str, Any]) -> None:
    assert "drop mpu=" in res["mpu"]


def test_additional_losses_of_the_wrong_kind_are_refused_by_name(res: dict[str, Any]) -> None:
    assert res["extra_list"].startswith("TypeError") and "returned a list" in res["extra_list"]
    assert res["extra_reserved"].startswith("ValueError") and "'lr'" in res["extra_reserved"]


def test_seed_layers_seeds_each_layer_of_each_forward_as_upstream(res: dict[str, Any]) -> None:
    assert res["seeded"] == [True, True, True]


def test_upstreams_layer_file_hooks_in_a_subclass_are_honoured(res: dict[str, Any]) -> None:
    """save_checkpoint writes through the subclass's save_state_dict and names;
    load_checkpoint calls its load_state_dir with load_module_strict, and the resumed run
    continues as the original did (other initial weights: the load did it)."""
    own = res["own_files"]
    layers = [f for f in own["files"] if f.startswith(("mine_", "layer_"))]
    assert layers == [f"mine_{i}.pt" for i in range(len(layers))] and len(layers) >= 3
    assert "extra.pt" in own["files"] and "mp_rank_00_model_states.pt" in own["files"]
    assert own["calls"] == [(False, 7)]
    assert own["continued"][0] == own["continued"][1]
    same, missing, misfit = own["direct"]
    assert same
    assert missing.startswith("CheckpointError") and "layer_00-model_states.pt" in missing
    assert misfit.startswith("CheckpointError") and "does not fit layer 0" in misfit
    assert "layer_00-model_states.pt" in misfit and "bogus" in misfit

"""offload_optimizer.step_in_forward ([Note: optimizer steps in forward]): the NVMe optimizer
updates of an engine.step() run in the next forward, each sub-group just before its
parameters are first read. Every result must be the one of the step run in engine.step(),
bit for bit, with gradient clipping, an LR schedule that moves every step, gradient
accumulation, persistent parameters, and a checkpoint saved while updates are pending."""

import os
from typing import Any

import torch

from tests.helpers.distributed import run_ranks

WATCHED = "blocks.0.qkv.weight"


def _engine(path: str, forward: bool, bf16: bool = False, client: bool = False) -> Any:
    """client: torch's AdamW with a tensor lr and a torch LambdaLR, which moves that tensor
    in place, instead of the config's optimizer and scheduler."""
    from deepspeed_ext.runtime.initialize import initialize
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32))
    nvme = {"device": "nvme", "nvme_path": path}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.05,  # below every step's norm here: each step is clipped
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 32,  # the LayerNorms stay gathered
            "sub_group_size": 1500,
            "offload_param": {**nvme, "max_in_cpu": 0},
            "offload_optimizer": {**nvme, "step_in_forward": forward},
        },
        "steps_per_print": 1000,
    }
    if bf16:  # 16-bit shards keep files of their own, written when their master steps
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": True}
    if not client:
        engine, _, _, _ = initialize(model=model, config=cfg)
        return engine
    del cfg["optimizer"], cfg["scheduler"]
    cfg["zero_force_ds_cpu_optimizer"] = False
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine, _, _, _ = initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    return engine


def _micro_steps(engine: Any, step: int, resident: bool = False, between: Any = None) -> float:
    """between(engine): called after the boundary backward, before its engine.step()."""
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = torch.zeros(())
    for micro in range(2):
        idx = torch.randint(0, 32, (2, 17), generator=g)
        loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        engine.backward(loss)
        if resident:  # partitions kept and zeroed in place, as with a GPU model
            engine.strategy.reducer.resident = True
        if micro == 1 and between is not None:
            between(engine)
        engine.step()
    return float(loss.detach())


def _watched(engine: Any) -> torch.Tensor:
    from deepspeed_ext.zero.stage3 import GatheredParameters

    p = dict(engine.module.named_parameters())[WATCHED]
    with GatheredParameters([p]):
        return p.detach().clone()


def _all(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed_ext.zero.stage3 import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _job(path: str, ckpt: str, forward: bool, resident: bool, bf16: bool = False) -> dict:
    engine = _engine(os.path.join(path, "run"), forward, bf16)
    out: dict[str, Any] = {"losses": [], "watched": [], "norms": [], "lrs": []}
    for step in range(3):
        out["losses"].append(_micro_steps(engine, step, resident))
        out["norms"].append(engine.get_global_grad_norm())
        out["lrs"].append(engine.get_lr()[0])
        if step == 0:  # read right after engine.step(): the update is there
            out["watched"].append(_watched(engine))
    engine.save_checkpoint(ckpt, tag="t")  # updates pending since the last step
    out["losses"].append(_micro_steps(engine, 3))
    out["final"] = _all(engine)  # steps every sub-group left (a forward would too)
    swap = engine.strategy.optimizer_swap
    # arenas in memory once the last sub-group stepped: its own, being written
    out["arenas_held"] = len(swap.arenas._spare), len({id(a) for a in swap._arena_of.values()})
    out["stats"] = dict(swap.stats)
    out["arenas"] = dict(engine.strategy.optimizer_swap.arenas.stats)
    shards = next(p.ds_swap for p in engine.module.parameters() if p.ds_swap is not None)
    out["shard_stats"] = dict(shards.stats)
    engine.destroy()
    # resumed from the checkpoint with the deferral off: the same last step
    again = _engine(os.path.join(path, "resumed"), False, bf16)
    again.load_checkpoint(ckpt, tag="t")
    out["resumed_loss"] = _micro_steps(again, 3)
    out["resumed"] = _all(again)
    again.destroy()
    return out


def _assert_equal(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["norms"] == b["norms"] and a["lrs"] == b["lrs"]
    for x, y in zip(a["watched"], b["watched"]):
        assert torch.equal(x, y)
    for n, v in b["final"].items():
        assert torch.equal(a["final"][n], v), n


def test_steps_in_forward_equal_the_step_in_engine_step(tmp_path):
    """Bit-equal to the same run with every update made in engine.step(), on 2 ranks; the
    checkpoint saved with updates pending resumes to the same last step."""
    ref = run_ranks(_job, 2, str(tmp_path / "ref"), str(tmp_path / "ck_ref"), False, False)
    got = run_ranks(_job, 2, str(tmp_path / "fwd"), str(tmp_path / "ck_fwd"), True, False)
    for a, b in zip(got, ref):
        _assert_equal(a, b)
        assert min(b["norms"]) > 0.05, b["norms"]  # clipping acted on every step
        assert len(set(b["lrs"])) == 3, b["lrs"]  # the schedule moved every step
        assert a["resumed_loss"] == a["losses"][-1]
        for n, v in a["final"].items():
            assert torch.equal(a["resumed"][n], v), n
    # The sub-groups of steps 0-1 stepped in the next forward as it first read their shards,
    # and step 3's in the final gather; the save settled step 2's (nothing had read them)
    stats = got[0]["stats"]
    assert stats["stepped_at_settle"] >= 4, stats  # several sub-groups a step
    assert stats["stepped_in_forward"] == 3 * stats["stepped_at_settle"], stats
    assert "stepped_in_forward" not in ref[0]["stats"], ref[0]["stats"]
    # each boundary backward read the next step's first three sub-groups
    assert stats["read_in_backward"] == 4 * 3, stats
    # [Note: sub-group arenas]: later sub-groups are read into the memory of earlier ones
    arenas = got[0]["arenas"]
    assert arenas["arenas_reused"] > arenas["arenas_made"], arenas
    assert got[0]["arenas_held"] == (0, 1), got[0]["arenas_held"]
    # a gather right after its sub-group stepped takes the new value from memory instead of
    # waiting for the write of the master's file, which is the shard's
    assert got[0]["shard_stats"]["fetched_fresh"] > 0, got[0]["shard_stats"]
    assert ref[0]["shard_stats"]["fetched_fresh"] == 0, ref[0]["shard_stats"]
    # the backward gathers the first layers last: from their masters read early, not from
    # the files again
    assert got[0]["shard_stats"]["fetched_mirror"] > 0, got[0]["shard_stats"]
    assert ref[0]["shard_stats"]["fetched_mirror"] == 0, ref[0]["shard_stats"]
    assert not list(tmp_path.rglob("*.swp")), "swap files are removed at the end"


def test_steps_in_forward_with_partitions_zeroed_in_place(tmp_path):
    """A reducer that keeps its gradient partitions (a GPU model with CPU gradients) zeroes
    them in place: the zeroing waits until the pending updates have read them."""
    ref = run_ranks(_job, 2, str(tmp_path / "ref"), str(tmp_path / "ck_ref"), False, True)
    got = run_ranks(_job, 2, str(tmp_path / "fwd"), str(tmp_path / "ck_fwd"), True, True)
    for a, b in zip(got, ref):
        _assert_equal(a, b)


def test_steps_in_forward_with_bf16_and_overflow_checks(tmp_path):
    """bf16 with bf16.check_grad_overflow (which step_in_backward refuses): each bf16 shard
    is written from its master when the sub-group steps, and gathered from its own file."""
    ref = run_ranks(_job, 2, str(tmp_path / "ref"), str(tmp_path / "ck_ref"), False, False, True)
    got = run_ranks(_job, 2, str(tmp_path / "fwd"), str(tmp_path / "ck_fwd"), True, False, True)
    for a, b in zip(got, ref):
        _assert_equal(a, b)
        for n, v in a["final"].items():
            assert torch.equal(a["resumed"][n], v), n
    assert got[0]["shard_stats"]["fetched_fresh"] == 0, got[0]["shard_stats"]
    assert got[0]["stats"]["stepped_in_forward"] > 0, got[0]["stats"]


def _client_job(path: str, forward: bool) -> dict:
    """Between steps: an evaluation forward under torch.inference_mode() (the updates it
    triggers must leave torch's optimizer state usable outside it), an engine.step() with
    no backward since the last (its norm is of zeroed gradients), and a GatheredParameters
    edit of a bf16 parameter (its master has a file of its own)."""
    from deepspeed_ext.zero.stage3 import GatheredParameters

    engine = _engine(path, forward, bf16=True, client=True)
    out: dict[str, Any] = {"losses": [], "norms": [], "watched": [], "lrs": []}
    out["losses"].append(_micro_steps(engine, 0, resident=True))
    out["norms"].append(engine.get_global_grad_norm())
    with torch.inference_mode():
        idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(7))
        out["eval"] = float(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    out["losses"].append(_micro_steps(engine, 1))
    for _ in range(2):  # one accumulation boundary, no backward (nor forward) since step 1
        engine.step()
    out["norms"].append(engine.get_global_grad_norm())
    p = dict(engine.module.named_parameters())[WATCHED]
    with GatheredParameters([p], modifier_rank=0):
        p.data.fill_(0.5)
    out["losses"].append(_micro_steps(engine, 2))
    out["mid"] = _watched(engine)
    # kept gathered across an engine.step(): the change made after it wins, deferred or not
    with GatheredParameters([p], modifier_rank=0):
        out["losses"].append(_micro_steps(engine, 3))
        p.data.fill_(0.25)
    out["final"] = _all(engine)
    engine.destroy()
    return out


def test_steps_in_forward_under_inference_mode_edits_and_client_schedulers(tmp_path):
    ref = run_ranks(_client_job, 2, str(tmp_path / "ref"), False)
    got = run_ranks(_client_job, 2, str(tmp_path / "fwd"), True)
    for a, b in zip(got, ref):
        assert a["eval"] == b["eval"]
        _assert_equal(a, b)
        assert b["norms"][1] == 0.0, b["norms"]
        assert torch.equal(a["mid"], b["mid"])
        # the edit reached the master: a step later the weight is still near 0.5
        assert (a["mid"].float() - 0.5).abs().max() < 0.1, a["mid"]
        # the last edit came after every step: the weight is exactly it
        assert bool((a["final"][WATCHED] == 0.25).all()), a["final"][WATCHED]


def _sub_groups(path: str, size: int | None, threshold: int = 0) -> str:
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    opt = {"device": "nvme", "nvme_path": path, "step_in_forward": True}
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_optimizer": opt,
        "stage3_param_persistence_threshold": threshold,
    }
    if size is not None:
        zero["sub_group_size"] = size
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
    }
    try:
        engine, _, _, _ = initialize(model=Net(), config=cfg)
    except ValueError as e:
        return str(e)
    total = sum(p.ds_shard_numel for p in engine.strategy.trainable)
    numel = engine.strategy.optimizer_swap.sub_group_numel
    engine.destroy()
    return f"sub-groups of {numel} of {total}"


def test_steps_in_forward_sub_group_size(tmp_path):
    """Left at its default (one sub-group of every master), sub_group_size becomes an
    eighth of the rank's masters; set explicitly to hold them all, it is refused by name,
    and so is the key when every parameter stays gathered (nothing to defer)."""
    auto = run_ranks(_sub_groups, 1, str(tmp_path), None)[0]
    total = int(auto.rsplit(" ", 1)[1])
    assert total > 8 and auto == f"sub-groups of {total // 8} of {total}", auto
    msg = run_ranks(_sub_groups, 1, str(tmp_path), 10**9)[0]
    assert "offload_optimizer.step_in_forward" in msg, msg
    assert "sub_group_size=1000000000" in msg and "set sub_group_size to about" in msg, msg
    msg = run_ranks(_sub_groups, 1, str(tmp_path), None, 10**5)[0]
    assert "step_in_forward has nothing to move" in msg and "lower the threshold" in msg, msg


def _by_default(path: str) -> dict[str, str]:
    """What each config makes of step_in_forward: on (and the sub-group size) or off."""
    from deepspeed_ext.runtime.initialize import initialize
    from tests.unit.zero.zero_runs import Net

    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "unset": ({}, {}),
        "unset, sub_group_size 1e9": ({}, {"sub_group_size": 10**9}),
        "unset, sub_group_size 100": ({}, {"sub_group_size": 100}),
        "unset, all persistent": ({}, {"stage3_param_persistence_threshold": 10**5}),
        "false": ({"step_in_forward": False}, {}),
        "unset, step_in_backward": ({"step_in_backward": True}, {}),
    }
    out = {}
    for name, (opt, zero) in cases.items():
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "offload_optimizer": {"device": "nvme", "nvme_path": path, **opt},
                **zero,
            },
        }
        engine, _, _, _ = initialize(model=Net(), config=cfg)
        s = engine.strategy
        total = sum(p.ds_shard_numel for p in s.trainable)
        mode = "forward" if s.forward_steps else "backward" if s.backward_steps else "step"
        out[name] = f"{mode} {s.optimizer_swap.sub_group_numel} of {total}"
        engine.destroy()
    return out


def test_steps_in_forward_by_default(tmp_path):
    """With offload_optimizer on NVMe the sub-groups step in the next forward unless the key
    is false or step_in_backward is set; sub_group_size is then an upper bound, and a model
    with nothing to defer steps in engine.step(), where the key set true is refused."""
    got = run_ranks(_by_default, 1, str(tmp_path))[0]
    total = int(got["unset"].rsplit(" ", 1)[1])
    eighth = f"{total // 8} of {total}"
    assert got["unset"] == f"forward {eighth}", got
    assert got["unset, sub_group_size 1e9"] == f"forward {eighth}", got
    assert got["unset, sub_group_size 100"] == f"forward 100 of {total}", got
    assert got["unset, all persistent"].startswith("step "), got
    assert got["false"] == f"step {10**9} of {total}", got
    assert got["unset, step_in_backward"] == f"backward {eighth}", got


def _between_job(path: str, ckpt: str, forward: bool) -> dict:
    """Between a boundary backward and its engine.step(), where the next step's first
    sub-groups are already read: a GatheredParameters edit (it writes the master's file,
    so their copy is stale), a checkpoint save (it reads every sub-group), a state dict."""
    from deepspeed_ext.zero.stage3 import GatheredParameters

    def edit(engine: Any) -> None:
        p = dict(engine.module.named_parameters())[WATCHED]
        with GatheredParameters([p], modifier_rank=0):
            p.data.fill_(0.5)

    def save(engine: Any) -> None:
        engine.save_checkpoint(ckpt, tag="between")

    engine = _engine(path, forward)
    out: dict[str, Any] = {"losses": [], "norms": [], "lrs": [], "watched": []}
    for step, between in enumerate([None, edit, save, None]):
        out["losses"].append(_micro_steps(engine, step, between=between))
        out["norms"].append(engine.get_global_grad_norm())
        out["lrs"].append(engine.get_lr()[0])
    out["final"] = _all(engine)
    out["stats"] = dict(engine.strategy.optimizer_swap.stats)
    engine.destroy()
    return out


def test_state_read_in_backward_is_dropped_by_what_changes_or_reads_it(tmp_path):
    """Bit-equal to the run with every update made in engine.step()."""
    ref = run_ranks(_between_job, 2, str(tmp_path / "ref"), str(tmp_path / "ck_ref"), False)
    got = run_ranks(_between_job, 2, str(tmp_path / "fwd"), str(tmp_path / "ck_fwd"), True)
    for a, b in zip(got, ref):
        _assert_equal(a, b)
    assert got[0]["stats"]["read_in_backward"] == 4 * 3, got[0]["stats"]


def _overflow_job(path: str) -> dict:
    """fp16 with a loss scale that overflows: the skipped step defers nothing, and the
    state read during its backward leaves memory instead of waiting a step."""
    from deepspeed_ext.runtime.initialize import initialize
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32))
    nvme = {"device": "nvme", "nvme_path": path}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "initial_scale_power": 32},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 1500,
            "offload_param": {**nvme, "max_in_cpu": 0},
            "offload_optimizer": nvme,
        },
    }
    engine, _, _, _ = initialize(model=model, config=cfg)
    idx = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {"early": []}
    for _ in range(2):
        engine.backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
        out["early"].append(len(engine.strategy.forward_steps._early))
        engine.step()
        out["early"].append(len(engine.strategy.forward_steps._early))
    out["skipped"] = engine.skipped_steps
    out["arenas_after"] = len(engine.strategy.optimizer_swap._arena_of)
    engine.destroy()
    return out


def test_state_read_in_backward_leaves_with_a_skipped_step(tmp_path):
    got = run_ranks(_overflow_job, 2, str(tmp_path))[0]
    assert got["skipped"] == 2, got
    assert got["early"] == [3, 0, 3, 0], got
    assert got["arenas_after"] == 0, got


def _hook_job(path: str) -> list[int]:
    """A boundary backward whose loss reaches no parameter (no gradient hook fires, so the
    backward's end callback never runs): the next, non-boundary, backward reads nothing
    early. Sub-groups read early after each backward."""
    engine = _engine(path, True)
    g = torch.Generator().manual_seed(5)
    early = []

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss)
        early.append(len(engine.strategy.forward_steps._early))

    for micro in range(4):  # accumulation 2: micro-steps 1 and 3 are boundaries
        if micro == 1:
            backward(torch.ones((), requires_grad=True) * 2.0)
        else:
            idx = torch.randint(0, 32, (2, 17), generator=g)
            backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
        engine.step()
    engine.destroy()
    return early


def test_state_is_read_early_in_boundary_backwards_only(tmp_path):
    got = run_ranks(_hook_job, 1, str(tmp_path))[0]
    assert got == [0, 0, 0, 3], got

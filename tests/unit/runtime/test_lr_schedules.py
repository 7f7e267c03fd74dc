"""LR schedules against upstream's documented formulas, written out plainly here.

Indexing: `i` is last_batch_iteration, the batch the lr is for (0 after the first step()).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from deepspeed_ext.runtime.lr_schedules import (
    VALID_LR_SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    add_tuning_arguments,
    get_config_from_args,
    get_lr_from_config,
    get_lr_scheduler,
)

TOL = 1e-12


def sgd(lrs: tuple[float, ...] = (0.1,)) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def adam(lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Adam:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups, lr=lrs[0], betas=(0.9, 0.999))


def run(sched, opt, n: int) -> list[list[float]]:
    """The group lrs for batches 0..n-1 (step() before each batch, as the engine does)."""
    out = []
    for _ in range(n):
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out


def close(a: list[list[float]], b: list[list[float]]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == pytest.approx(y, abs=TOL, rel=1e-12), f"batch {i}: {x} != {y}"


# ---------------------------------------------------------------- WarmupLR / WarmupDecayLR


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_per_group(warmup_type):
    lo, hi, n = [0.0, 0.01], [1.0, 0.05], 8
    opt = sgd((0.3, 0.3))
    sched = WarmupLR(opt, lo, hi, warmup_num_steps=n, warmup_type=warmup_type)
    assert [g["lr"] for g in opt.param_groups] == lo  # written at construction

    def expected(i: int) -> list[float]:
        if i < n:
            g = math.log(i + 1) / math.log(n) if warmup_type == "log" else i / n
        else:
            g = 1.0
        return [a + (b - a) * g for a, b in zip(lo, hi)]

    close(run(sched, opt, n + 5), [expected(i) for i in range(n + 5)])
    assert sched.get_last_lr() == hi


def test_warmup_num_steps_floor_and_unknown_type():
    opt = sgd()
    sched = WarmupLR(opt, 0.0, 1.0, warmup_num_steps=1, warmup_type="cubic")
    assert sched.warmup_num_steps == 2 and sched.warmup_type == "log"  # upstream's fallbacks
    close(run(sched, opt, 3), [[0.0], [math.log(2) / math.log(2)], [1.0]])


@pytest.mark.parametrize("value", [0, -5, 10.0, None, True, "10"])
@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_warmup_num_steps_must_be_a_positive_int(name, value):
    """Upstream refuses all but an int of 1 or more (ours refuses True too); the message
    names the param and the value and says what to give."""
    extra = {} if name == "WarmupLR" else {"total_num_steps": 10}
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    opt = sgd()
    with pytest.raises(
        ValueError, match=rf"warmup_num_steps must be a positive integer, got {value!r}: "
    ):
        cls[name](opt, warmup_num_steps=value, **extra)
    assert opt.param_groups[0]["lr"] == 0.1  # refused before touching the optimizer
    fix = "write 10, without" if isinstance(value, float) else "give a whole number"
    with pytest.raises(ValueError, match=fix):
        get_lr_scheduler(name, opt, {"warmup_num_steps": value, **extra})
    cls[name](opt, warmup_num_steps=1, **extra)  # 1 is accepted, as upstream (then taken as 2)


@pytest.mark.parametrize("value", [0, 2.0, 2.5, None])
def test_lr_range_test_step_size_must_be_a_positive_int(value):
    with pytest.raises(
        ValueError, match=rf"lr_range_test_step_size must be a positive integer, got {value!r}"
    ):
        LRRangeTest(sgd(), lr_range_test_step_size=value)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type):
    lo, hi, n, total = 0.001, 0.1, 5, 20
    opt = sgd()
    sched = WarmupDecayLR(opt, total, lo, hi, n, warmup_type)

    def expected(i: int) -> float:
        if i < n:
            g = math.log(i + 1) / math.log(n) if warmup_type == "log" else i / n
        else:
            g = max(0.0, (total - i) / max(1.0, total - n))
        return lo + (hi - lo) * g

    # runs past total_num_steps: the factor bottoms out at 0 -> lr = warmup_min_lr
    close(run(sched, opt, total + 4), [[expected(i)] for i in range(total + 4)])
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)


def log_warmup(i: int, n: int) -> float:
    return math.log(i + 1) / math.log(n) if i < n else 1.0


@pytest.mark.parametrize("explicit_none", [False, True])
def test_warmup_lr_max_defaults_to_each_groups_lr(explicit_none):
    """Upstream's WarmupLR warms up to the lr each group was given when warmup_max_lr is left
    out (or None): min 0.001 with an optimizer lr of 0.01 rises to 0.01, not to 0.001."""
    base, lo, n = (0.01, 0.5), 0.001, 4
    opt = sgd(base)
    kw = {"warmup_max_lr": None} if explicit_none else {}
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_num_steps=n, **kw)
    assert sched.max_lrs == list(base)
    expected = [[lo + (b - lo) * log_warmup(i, n) for b in base] for i in range(n + 3)]
    close(run(sched, opt, n + 3), expected)


def test_warmup_lr_max_default_through_the_config_factory():
    opt = sgd((0.01,))
    sched = get_lr_scheduler("WarmupLR", opt, {"warmup_min_lr": 0.001, "warmup_num_steps": 4})
    run(sched, opt, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_warmup_decay_lr_max_default_and_none():
    """WarmupDecayLR keeps upstream's own default of 0.001; None means the groups' lrs."""
    assert WarmupDecayLR(sgd((0.5,)), 10).max_lrs == [0.001]
    assert WarmupDecayLR(sgd((0.5,)), 10, warmup_max_lr=None).max_lrs == [0.5]


# ---------------------------------------------------------------- WarmupCosineLR


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type):
    base, total, n, w, c = (0.5, 0.1), 20, 5, 0.1, 0.01
    opt = sgd(base)
    sched = WarmupCosineLR(opt, total, w, n, c, warmup_type)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([b * w for b in base])

    def ratio(i: int) -> float:
        if i < n:
            g = math.log(i + 1) / math.log(n) if warmup_type == "log" else i / n
            return w + (1 - w) * g
        s = min(i - n + 1, total - n)  # cosine step, held at the end past total_num_steps
        return max(0.0, c + (1 - c) * (1 + math.cos(math.pi * s / (total - n))) / 2)

    got = run(sched, opt, total + 3)
    close(got, [[b * ratio(i) for b in base] for i in range(total + 3)])
    assert got[total - 1] == pytest.approx([b * c for b in base])  # floor reached at T-1
    assert got[-1] == pytest.approx([b * c for b in base])  # and held after


def test_warmup_cosine_no_room_for_decay():
    opt = sgd((1.0,))
    sched = WarmupCosineLR(opt, total_num_steps=3, warmup_num_steps=3, cos_min_ratio=0.2)
    assert run(sched, opt, 5)[3:] == [[0.2], [0.2]]


# ---------------------------------------------------------------- OneCycle


def one_cycle_scale(i: int, first: int, second: int) -> float:
    size, r = first + second, first / (first + second)
    b = i + 1
    x = 1 + b / size - math.floor(1 + b / size)
    return x / r if x <= r else (x - 1) / (r - 1)


@pytest.mark.parametrize("decay", [True, False])
def test_one_cycle_lr(decay):
    lo, hi, first, second, d_size, rate = 0.01, 0.1, 4, 6, 2, 0.5
    opt = sgd()
    sched = OneCycle(
        opt,
        lo,
        hi,
        decay_lr_rate=rate if decay else 0.0,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        decay_step_size=d_size,
    )
    assert opt.param_groups[0]["lr"] == lo
    size = first + second

    def expected(i: int) -> float:
        if i < size:
            return lo + (hi - lo) * one_cycle_scale(i, first, second)
        if not decay:
            return lo
        return lo / (1 + rate * (i - size + 1) / d_size)

    got = run(sched, opt, size + 8)
    close(got, [[expected(i)] for i in range(size + 8)])
    assert got[first - 1] == pytest.approx([hi])  # the peak ends the rising half
    assert got[size - 1] == pytest.approx([lo])  # back at the floor at the cycle's end


def test_one_cycle_momentum_cycles_beta1():
    lo_m, hi_m, first, d_size, m_rate = 0.8, 0.9, 3, 2, 0.05
    opt = adam()
    sched = OneCycle(
        opt,
        0.01,
        0.1,
        cycle_first_step_size=first,
        decay_step_size=d_size,
        cycle_min_mom=lo_m,
        cycle_max_mom=hi_m,
        decay_mom_rate=m_rate,
    )
    assert opt.param_groups[0]["betas"] == (hi_m, 0.999)  # momentum mirrors lr: max at start
    size = 2 * first

    def beta1(i: int) -> float:
        if i < size:
            return hi_m - (hi_m - lo_m) * one_cycle_scale(i, first, first)
        return hi_m * (1 + m_rate * (i - size + 1) / d_size)

    got = []
    for _ in range(size + 4):
        sched.step()
        got.append(opt.param_groups[0]["betas"])
    for i, betas in enumerate(got):
        assert betas[0] == pytest.approx(beta1(i), abs=TOL), i
        assert betas[1] == 0.999  # beta2 is left alone
    assert got[first - 1][0] == pytest.approx(lo_m)  # lr peak <-> momentum trough
    assert sched.get_mom() == [got[-1]]


def one_cycle_stair_scale(i: int, first: int, second: int, n1: int, n2: int) -> float:
    """The cycle in stairs: each half's n stairs are equal runs of its batches, the level of
    stair j being j / n; k is the batch's place in the cycle (k <= first: rising)."""
    size = first + second
    k = (i + 1) % size
    if k <= first:
        return one_cycle_scale(i, first, second) if n1 <= 0 else math.floor(k * n1 / first) / n1
    if n2 <= 0:
        return one_cycle_scale(i, first, second)
    return math.floor((size - k) * n2 / second) / n2


def test_one_cycle_stairs_by_hand():
    """first 4, two stairs: the rising half holds 0, 0.5, 0.5, then the peak; the falling
    half (second_stair_count left out: also two) 0.5, 0.5, 0, and the next cycle starts at 0.
    (Upstream 0.19.8 gives these lrs too.)"""
    opt = adam()
    sched = OneCycle(
        opt, 0.01, 0.1, cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False
    )
    close(run(sched, opt, 8), [[0.01 + 0.09 * s] for s in (0, 0.5, 0.5, 1, 0.5, 0.5, 0, 0)])


@pytest.mark.parametrize(
    "first, second, n1, n2",
    [(4, 4, 2, None), (4, 6, 0, 3), (5, 3, 2, 3), (6, 9, 4, -1), (10, 10, 3, 7), (3, 3, 5, 5)],
)
def test_one_cycle_stairs(first, second, n1, n2):
    lo, hi, lo_m, hi_m = 0.01, 0.1, 0.8, 0.9
    opt = adam()
    sched = OneCycle(
        opt,
        lo,
        hi,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_first_stair_count=n1,
        cycle_second_stair_count=n2,
        cycle_min_mom=lo_m,
        cycle_max_mom=hi_m,
    )
    size = first + second
    scales = [
        one_cycle_stair_scale(i, first, second, n1, n1 if n2 is None else n2) for i in range(size)
    ]
    got, betas = [], []
    for _ in range(size):
        sched.step()
        got.append([opt.param_groups[0]["lr"]])
        betas.append(opt.param_groups[0]["betas"][0])
    close(got, [[lo + (hi - lo) * s] for s in scales])
    assert betas == pytest.approx([hi_m - (hi_m - lo_m) * s for s in scales], abs=TOL)


def test_one_cycle_stair_count_must_be_a_number():
    with pytest.raises(ValueError, match="cycle_first_stair_count must be a number.*None"):
        OneCycle(adam(), 0.01, 0.1, cycle_first_stair_count=None)


def test_one_cycle_momentum_off_without_betas():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.5)
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    assert not sched.cycle_momentum and sched.get_mom() is None
    run(sched, opt, 5)
    assert opt.param_groups[0]["momentum"] == 0.5 and "betas" not in opt.param_groups[0]


# ---------------------------------------------------------------- LRRangeTest


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    lo, size, rate = (0.001, 0.01), 3, 2.0
    opt = sgd((0.5, 0.5))
    sched = LRRangeTest(opt, list(lo), size, rate, staircase)
    assert [g["lr"] for g in opt.param_groups] == list(lo)

    def expected(i: int) -> list[float]:
        k = (i + 1) / size
        if staircase:
            k = math.floor(k)
        return [m * (1 + rate * k) for m in lo]

    close(run(sched, opt, 10), [expected(i) for i in range(10)])


# ---------------------------------------------------------------- stepping, state, errors

CASES = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 5},
    "WarmupDecayLR": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1},
    "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3},
    "LRRangeTest": {"lr_range_test_step_size": 2, "lr_range_test_staircase": True},
}


def test_cases_cover_every_schedule():
    assert sorted(CASES) == sorted(VALID_LR_SCHEDULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trip(name):
    k, more = 6, 10
    opt = adam()  # betas too, so OneCycle's momentum is resumed as well
    ref = get_lr_scheduler(name, opt, CASES[name])
    uninterrupted = run(ref, opt, k + more)

    opt1 = adam()
    first = get_lr_scheduler(name, opt1, CASES[name])
    run(first, opt1, k)
    sd = first.state_dict()
    assert sd == {"last_batch_iteration": k - 1}  # upstream's contents

    opt2 = adam()  # a fresh process: new optimizer, new schedule, then the saved state
    second = get_lr_scheduler(name, opt2, CASES[name])
    second.load_state_dict(sd)
    resumed = run(second, opt2, more)
    close(resumed, uninterrupted[k:])
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_step_to_explicit_index_and_resume_by_constructor():
    opt = sgd()
    a = WarmupLR(opt, 0.0, 1.0, 10, "linear")
    a.step(7)
    assert a.last_batch_iteration == 7 and a.get_last_lr() == [pytest.approx(0.7)]

    opt2 = sgd((0.42,))
    b = WarmupLR(opt2, 0.0, 1.0, 10, "linear", last_batch_iteration=7)
    assert opt2.param_groups[0]["lr"] == 0.42  # a resumed schedule leaves the optimizer alone
    with pytest.raises(RuntimeError, match="step"):
        b.get_last_lr()
    b.step()
    assert b.get_last_lr() == [pytest.approx(0.8)]


def test_scheduled_lr_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = WarmupLR(opt, 0.0, 1.0, 4, "linear")
    for _ in range(3):
        sched.step()
        p.grad = torch.ones(1)
        opt.step()
    assert p.item() == pytest.approx(-(0.0 + 0.25 + 0.5))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_tensor_lr_stays_the_same_tensor(name):
    """torch takes a tensor lr; the schedule fills it in place (as upstream) instead of
    replacing it by a float, and follows the same values as with a float lr."""
    ref_opt = adam()
    ref = run(get_lr_scheduler(name, ref_opt, CASES[name]), ref_opt, 8)
    lr = torch.tensor(0.1)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=lr, betas=(0.9, 0.999))
    sched = get_lr_scheduler(name, opt, CASES[name])
    for i in range(8):
        sched.step()
        assert opt.param_groups[0]["lr"] is lr, f"batch {i}"
        assert lr.item() == pytest.approx(ref[i][0], rel=1e-6, abs=1e-9), f"batch {i}"
        assert sched.get_last_lr()[0] is lr
    p.grad = torch.ones(2)
    opt.step()  # the optimizer still steps with its tensor lr


def test_wrapped_optimizer_and_bad_optimizer():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    opt = sgd()
    sched = WarmupLR(Wrapper(opt), 0.0, 1.0, 4, "linear")
    assert sched.optimizer is opt
    with pytest.raises(TypeError, match="Optimizer"):
        WarmupLR(object())


def test_per_group_length_mismatch():
    with pytest.raises(ValueError, match="warmup_max_lr: expected 2 values"):
        WarmupLR(sgd((0.1, 0.1)), 0.0, [0.1, 0.2, 0.3])


_NOT_NUMBERS = ["0.001", ["0.001"], torch.tensor([0.1, 0.2])]


@pytest.mark.parametrize(
    "name, value",
    [("warmup_min_lr", v) for v in [*_NOT_NUMBERS, None]]
    + [("warmup_max_lr", v) for v in _NOT_NUMBERS],  # None is the groups' own lr there
)
def test_a_string_for_a_number_names_the_param(name, value):
    """A string was read as a list of characters ("expected 1 values ... got 5")."""
    with pytest.raises(TypeError, match=rf"{name} must be a number or a list of numbers, one per"):
        WarmupLR(sgd(), **{name: value})
    with pytest.raises(ValueError, match=rf"{name} must be a number or a list of numbers"):
        get_lr_scheduler("WarmupLR", sgd(), {name: value})


def test_one_cycle_and_cosine_string_params_are_named():
    with pytest.raises(TypeError, match="cycle_max_lr must be a number.*'0.1'.*without quotes"):
        OneCycle(adam(), 0.01, "0.1")
    with pytest.raises(TypeError, match="warmup_min_ratio must be a number, got"):
        WarmupCosineLR(sgd(), 10, warmup_min_ratio=[0.1])


def test_get_lr_scheduler_by_name():
    opt = sgd()
    sched = get_lr_scheduler("WarmupDecayLR", opt, {"total_num_steps": 10, "warmup_max_lr": 0.2})
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 10
    step = get_lr_scheduler("StepLR", opt, {"step_size": 2})  # torch fallback, as upstream
    assert isinstance(step, torch.optim.lr_scheduler.StepLR)


def test_get_lr_scheduler_unknown_type_suggests():
    with pytest.raises(ValueError, match=r"unknown scheduler type 'WarmupLr'.*'WarmupLR'"):
        get_lr_scheduler("WarmupLr", sgd(), {})


def test_get_lr_scheduler_bad_and_missing_params():
    with pytest.raises(ValueError, match=r"unknown param 'warmup_max_l'.*'warmup_max_lr'"):
        get_lr_scheduler("WarmupLR", sgd(), {"warmup_max_l": 0.1})
    with pytest.raises(ValueError, match="missing required param.*total_num_steps"):
        get_lr_scheduler("WarmupCosineLR", sgd(), {"warmup_num_steps": 5})
    with pytest.raises(ValueError, match="cycle_min_lr, cycle_max_lr"):
        get_lr_scheduler("OneCycle", sgd(), {})


def test_tuning_arguments_to_config():
    parser = add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_max_lr", "0.02"])
    config, err = get_config_from_args(args)
    assert err is None and config is not None and config["type"] == "WarmupLR"
    assert get_lr_from_config(config) == (0.02, "")
    sched = get_lr_scheduler(config["type"], sgd(), config["params"])
    assert isinstance(sched, WarmupLR) and sched.max_lrs == [0.02]
    args = parser.parse_args(["--lr_schedule", "WarmupCosineLR"])
    config, _ = get_config_from_args(args)
    assert config is not None
    get_lr_scheduler(config["type"], sgd(), {**config["params"], "total_num_steps": 10})
    assert get_config_from_args(parser.parse_args([]))[0] is None


def test_face_import():
    import deepspeed_ext.runtime.lr_schedules as impl
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR

    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    assert WarmupLR is impl.WarmupLR  # one class, one home: the face re-exports it
    import deepspeed.runtime.lr_schedules as face

    assert sorted(face.__all__) == sorted(impl.__all__)
    assert all(getattr(face, n) is getattr(impl, n) for n in impl.__all__)

"""The dynamic loss scale follows upstream's rules ([Note: dynamic loss scale])."""

import pytest

from deepspeed_ext.runtime.precision import DynamicLossScaler, LossScaleError, StaticLossScaler


def test_overflow_halves_after_hysteresis_and_grows_after_window():
    s = DynamicLossScaler(init_scale=1024, scale_window=3, hysteresis=2, min_scale=1)
    s.update(True)  # absorbed by hysteresis
    assert s.loss_scale == 1024
    s.update(True)  # allowance used up: halve
    assert s.loss_scale == 512
    for _ in range(3):
        s.update(False)
        assert s.loss_scale == 512
    # upstream's count: the window's 3 clean steps follow the first one after the overflow
    s.update(False)
    assert s.loss_scale == 1024


def test_the_scale_sequence_is_upstreams():
    """Window 2, hysteresis 2, overflows at steps 2 and 3: the scales each step used, as
    DeepSpeed 0.19.8's DynamicLossScaler gives them (it grew one step early here)."""
    s = DynamicLossScaler(init_scale=256, scale_window=2, hysteresis=2, min_scale=1)
    used = []
    for step in range(1, 9):
        used.append(s.loss_scale)
        s.update(step in (2, 3))
    assert used == [256, 256, 256, 128, 128, 128, 256, 256]
    s = DynamicLossScaler(init_scale=8, scale_window=1, hysteresis=1)
    s.update(False)  # window 1: not at the very first step
    assert s.loss_scale == 8


def test_a_scale_below_the_minimum_is_raised_to_it_not_stopped():
    s = DynamicLossScaler(init_scale=1, scale_window=10, hysteresis=1, min_scale=4)
    s.update(True)
    assert s.loss_scale == 4
    with pytest.raises(LossScaleError, match="bf16"):
        s.update(True)


def test_a_static_scalers_state_starts_a_dynamic_one_at_its_scale():
    s = DynamicLossScaler(init_scale=2**16, scale_window=2, hysteresis=2)
    s.load_state_dict({"cur_scale": 128.0})
    assert s.loss_scale == 128 and s.cur_hysteresis == 2
    for _ in range(3):
        s.update(False)
    assert s.loss_scale == 256


def test_consecutive_hysteresis_refills_after_each_clean_step():
    s = DynamicLossScaler(
        init_scale=64, scale_window=100, hysteresis=2, consecutive_hysteresis=True
    )
    s.update(True)
    s.update(False)  # refills the allowance
    s.update(True)
    assert s.loss_scale == 64
    s.update(True)
    assert s.loss_scale == 32


def test_min_scale_stop_recommends_bf16():
    s = DynamicLossScaler(init_scale=4, scale_window=1000, hysteresis=1, min_scale=1)
    s.update(True)
    s.update(True)
    assert s.loss_scale == 1
    with pytest.raises(LossScaleError, match="bf16"):
        s.update(True)


def test_state_dict_roundtrip():
    a = DynamicLossScaler(init_scale=256, scale_window=2, hysteresis=2)
    for o in (True, False, True, True, False):
        a.update(o)
    b = DynamicLossScaler(init_scale=256, scale_window=2, hysteresis=2)  # config, not state
    b.load_state_dict(a.state_dict())
    for o in (False, False, True, True, False, False):
        a.update(o)
        b.update(o)
        assert a.loss_scale == b.loss_scale


def test_static_scale_never_changes():
    s = StaticLossScaler(128)
    s.update(True)
    assert s.loss_scale == 128

"""get_accelerator() on a CPU-only machine: what the runtime relies on."""

import pytest
import torch

import deepspeed_ext.accelerator as acc_mod
from deepspeed_ext.accelerator import get_accelerator, set_accelerator
from deepspeed_ext.accelerator.cpu import CPUAccelerator


@pytest.fixture(autouse=True)
def _fresh():
    set_accelerator(None)
    yield
    set_accelerator(None)


def test_cpu_when_no_gpu(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()


def test_forcing_an_unavailable_accelerator_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="DS_ACCELERATOR=cuda"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="'tpu'"):
        get_accelerator()


def test_cpu_memory_stats_track_the_process_rss():
    acc = CPUAccelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    during = acc.memory_allocated()
    assert during - before > 48 * 2**20
    del big
    # The kernel's peak (VmHWM) lags RSS by per-CPU accounting slack: allow 2 MiB.
    assert acc.max_memory_allocated() >= during - 2 * 2**20
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < during - 32 * 2**20, "reset should drop the freed peak"


def test_streams_events_are_noops_and_rng_roundtrips():
    acc = CPUAccelerator()
    s = acc.Stream()
    with acc.stream(s):
        e = acc.Event(enable_timing=True)
        e.record()
        s.wait_event(e)
    acc.synchronize()
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_op_builder_lookup():
    acc = CPUAccelerator()
    assert acc.create_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert acc.get_op_builder("NoSuchBuilder") is None


def test_pin_memory_is_identity_on_cpu():
    t = torch.zeros(4)
    assert CPUAccelerator().pin_memory(t) is t


def test_module_exports():
    assert set(acc_mod.__all__) >= {"get_accelerator", "set_accelerator"}

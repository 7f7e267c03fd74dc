"""Device-strict mode ([Note: device-strict mode] in accelerator/strict.py): on the CPU, code
that would break on a GPU (a host tensor handed to NCCL, a host read of an unfinished async
copy) raises, so the CPU suite finds it."""

from __future__ import annotations

import os

import pytest
import torch

from deepspeed_ext.accelerator import strict
from tests.helpers.distributed import run_ranks

from .strict_runs import strict_collectives


def test_suite_runs_strict():
    # conftest turns it on for every rank the suite spawns (and every launcher job)
    assert os.environ.get(strict.ENV) == "1"


def test_rules_in_one_process():
    with strict.scope():
        assert strict.is_host(torch.zeros(2))  # no device: torch's default, the host
        assert not strict.is_host(torch.zeros(2, device="cpu"))  # a device named
        assert strict.is_host(torch.zeros(2).view(1, 2))  # views and ops of host tensors
        assert strict.is_host(torch.zeros(2) + torch.ones(2))
        dev = torch.zeros(2).to("cpu")  # moved to a device
        assert not strict.is_host(dev)
        assert not strict.is_host(dev + torch.zeros(2))  # mixed: lands on the device
        assert strict.is_host(dev.cpu()) is False  # the same tensor on a CPU machine
        assert strict.is_host(torch.zeros(2).to(torch.float64))  # a dtype only: stays host
        assert strict.is_host(torch.empty_like(torch.zeros(2)))
        assert not strict.is_host(torch.empty_like(dev))
        host = strict.mark_host(torch.empty(2, device="cpu"))
        host.copy_(dev, non_blocking=True)
        assert strict.pending(host)
        with pytest.raises(strict.StrictDeviceError, match="non_blocking"):
            host.add_(1)
        host.size()  # metadata is no read
        strict.synced_through()
        host.add_(1)
        with pytest.raises(strict.StrictDeviceError, match="host tensor"):
            strict.check_collective("all_reduce", [torch.ones(1)], device_group=True)
        strict.check_collective("all_reduce", [torch.ones(1)], device_group=False)
    assert not strict.active()


def test_collectives_over_two_ranks():
    for r in run_ranks(strict_collectives, 2, timeout=120):
        assert r["active"]
        assert "host tensor" in r["host_refused"] and "collective_device" in r["host_refused"]
        assert "host tensor" in r["derived_refused"]
        assert r["device_sum"] == [2.0] * 3 and r["moved_sum"] == [2.0] * 3
        assert r["side_sum"] == [2.0] * 3 and r["side_device"] == "cpu"
        assert r["sums_over"] == [2.0, 5.0]
        assert "non_blocking" in r["pending_read_refused"]
        assert "still being written" in r["pending_collective_refused"]
        assert r["after_event"] == 6.0 and r["after_synchronize"] == 6.0
        assert "non-contiguous" in r["sliced_refused"] and "strides (4, 1)" in r["sliced_refused"]
        assert r["channels_last_sum"] == 24.0
        assert r["gathered_into_views"] == [[0.0] * 3, [1.0] * 3]
        assert r["broadcast_view"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]  # rank 0's

"""Upstream's ZeRO memory estimators at upstream's import paths. Their per-rank figures come
from zero_model_state_memory, whose formulas test_zero_memory.py checks against the live
tensors of real runs; here: what each function returns and prints, parameter counting, and
how offload and zero.Init move memory between GPU and CPU."""

from __future__ import annotations

import pytest
from torch import nn

from deepspeed.runtime.zero import stage3, stage_1_and_2
from deepspeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_live,
)
from deepspeed_ext.zero.estimate import zero_model_state_memory

PSI, LARGEST = 1_000_000_000, 50_000_000


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)  # 800
        self.body = nn.Linear(8, 8)  # 72
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight  # counted once


def test_model_to_params_counts_shared_weights_once() -> None:
    # as upstream: stage3's is (total, largest layer); stage_1_and_2's the total alone, an
    # int that its estimator takes (100*8 embedding, shared with the head, + 8*8 + 8)
    assert stage3.model_to_params(Tied()) == (872, 800)
    total = stage_1_and_2.model_to_params(Tied())
    assert total == 872 and type(total) is int
    cpu, gpu = estimate_zero2_model_states_mem_needs(total, 1, 1, cpu_offload=False)
    assert gpu == int(2 * 872 + (4 + 12) * 872)


def test_zero2_gpu_memory_is_the_stage2_layout() -> None:
    cpu, gpu = estimate_zero2_model_states_mem_needs(PSI, 8, 1, cpu_offload=False)
    # 16-bit params in full, fp32 gradient partitions and 12 bytes of Adam state per param
    assert gpu == int(2 * PSI + (4 + 12) * PSI / 8)
    assert cpu == int(4 * PSI * 8 * 1.5)  # each process builds the fp32 model first
    cpu_off, gpu_off = estimate_zero2_model_states_mem_needs(PSI, 8, 1, cpu_offload=True)
    assert gpu_off == 2 * PSI  # only the 16-bit parameters stay on the GPU
    assert cpu_off > cpu


def test_zero3_offload_and_zero_init_move_memory() -> None:
    def est(**kw: bool) -> tuple[int, int, int]:
        return estimate_zero3_model_states_mem_needs(PSI, LARGEST, 8, 2, **kw)

    cpu_all, gpu_all, window = est(cpu_offload=True, cpu_offload_params=True)
    cpu_opt, gpu_opt, _ = est(cpu_offload=True, cpu_offload_params=False)
    cpu_none, gpu_none, _ = est(cpu_offload=False, cpu_offload_params=False)
    assert window == (2 + 4) * LARGEST  # the gathered layer's params and gradients
    assert gpu_all == window < gpu_opt < gpu_none
    assert cpu_all > cpu_opt > cpu_none
    assert gpu_none == zero_model_state_memory(PSI, 16, 3, largest_layer_params=LARGEST).device
    cold, _, _ = est(cpu_offload=False, cpu_offload_params=False, zero_init=False)
    assert cold > cpu_none  # without zero.Init every process holds the fp32 model first


def test_all_live_and_all_cold_print_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 3000))
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
    out = capsys.readouterr().out
    assert "1 node, 4 GPUs per node" in out and "Model with 4M total params" in out
    assert out.count("offload_optimizer=") == 2
    estimate_zero3_model_states_mem_needs_all_live(model)
    out = capsys.readouterr().out
    assert "3M largest layer params" in out
    assert out.count("zero_init=") == 6  # (offload both, optimizer only, none) x zero_init
    estimate_zero3_model_states_mem_needs_all_cold(PSI, LARGEST, 8, 2)
    assert "2 nodes, 8 GPUs per node" in capsys.readouterr().out


def test_bad_arguments_say_which() -> None:
    with pytest.raises(ValueError, match="stage=4"):
        zero_model_state_memory(PSI, 2, 4)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        zero_model_state_memory(PSI, 2, 2, offload_param=True)

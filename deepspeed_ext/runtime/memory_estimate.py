"""A whole job's memory per rank before it runs: model states + activations + the buffers the
runtime keeps in flight, from the model and the DeepSpeed config.

[Note: whole-job memory estimate]
  model states   zero_model_state_memory ([Note: model-state memory]) without stage 3's
                 gathered window, which the buffers below model as this runtime runs it.
                 Stage 3's gradient partitions are made during backward, as activations
                 are freed, so counting them beside the activations is an upper bound
  activations    what autograd saves in one forward of a micro-batch (activation_bytes()
                 measures it on a sample batch; the caller may pass its own figure)
  buffers        stage 2: the reduce buckets alive at once (the one filling + 2 in flight);
                 stage 3: the larger of the gathered parameters (stage3_prefetch_bucket_size
                 + stage3_max_live_parameters, at most the model) and the gradient bucket pool
                 (the one filling and the one in flight share reduce_bucket_size), plus the
                 largest parameter's full gradient (alive until its hook copies it into a
                 bucket) and the parameters kept whole
                 (at most stage3_param_persistence_threshold elements each). Gathered
                 parameters and filled buckets trade places during backward (a module's
                 parameters are released as its gradients land), so their larger one counts.
                 Stages 0 and 1 reduce in their full-size gradient buffers: nothing more.
                 On gloo, stages 1-3 add the scratch of the reduce-scatters in flight
                 ([Note: reduce-scatter by exchange]: at most 16 MB a process).
Not counted: the process itself (interpreter, torch and its optimizer machinery: about 100
MB of host memory per rank on torch 2.13, whatever the model), the model built whole before
partitioning (4 bytes a parameter for a moment, unless built under zero.Init), and memory
the allocator keeps after frees (glibc keeps freed heap memory; MALLOC_MMAP_THRESHOLD_=131072
returns it). bench/zero3_step.py and tests/unit/runtime/test_memory_estimate.py compare
it with measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.comm.exchange import budget as exchange_budget
from deepspeed_ext.comm.exchange import scratch_bytes
from deepspeed_ext.config import DeepSpeedConfig, parse
from deepspeed_ext.zero.estimate import model_param_count, zero_model_state_memory

from .precision import config_dtype
from .strategy_factory import reduce_bucket_numel

MB = 1 << 20


@dataclass(frozen=True)
class JobMemory:
    """Per-rank bytes on the training device (host bytes when offloaded are `host`)."""

    model_states: int
    activations: int
    buffers: int
    host: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers

    def table(self) -> str:
        rows = [
            ("model states", self.model_states),
            ("activations", self.activations),
            ("buffers", self.buffers),
            ("total", self.total),
        ]
        out = [f"{name:<14} {b / MB:10.1f} MB" for name, b in rows]
        if self.host:
            out.append(f"{'host (offload)':<14} {self.host / MB:10.1f} MB")
        return "\n".join(out)


def activation_bytes(model: nn.Module, *inputs: Any) -> int:
    """Bytes autograd saves for backward in one forward of `model` on `inputs` (each
    storage once; parameters, which are model states, not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    del out
    return sum(seen.values())


def estimate_job_memory(
    model: nn.Module, config: Any, world_size: int, activations: int
) -> JobMemory:
    """[Note: whole-job memory estimate] for `model` trained with `config` (a dict, path or
    DeepSpeedConfig) on `world_size` data-parallel ranks, `activations` bytes a micro-batch."""
    cfg = config if isinstance(config, DeepSpeedConfig) else parse(config)
    zero = cfg.zero_optimization
    stage = int(zero.stage)
    psi = model_param_count(model)
    params = list(model.parameters())
    p_bytes = 2 if cfg.fp16.enabled or cfg.bf16.enabled else 4
    g_bytes = config_dtype(cfg.data_types.grad_accum_dtype or "fp32").itemsize
    comm = cfg.communication_data_type
    c_bytes = config_dtype(comm).itemsize if comm else g_bytes
    off_opt = str(getattr(zero.offload_optimizer, "device", "none") or "none") != "none"
    off_opt = off_opt and stage > 0  # stage 0 keeps the optimizer beside the model
    off_param = str(getattr(zero.offload_param, "device", "none") or "none") != "none"
    states = zero_model_state_memory(
        psi,
        world_size,
        stage,
        param_bytes=p_bytes,
        grad_bytes=g_bytes,
        offload_optimizer=off_opt,
        offload_param=off_param and stage == 3,
    )
    bucket = min(reduce_bucket_numel(zero, stage, params, g_bytes), psi)
    buffers = 0
    if stage == 2:
        buffers = min(3 * bucket, psi) * c_bytes
    elif stage == 3:
        gathered = min(
            psi, int(zero.stage3_prefetch_bucket_size) + int(zero.stage3_max_live_parameters)
        )
        pool = bucket * c_bytes  # [Note: stage-3 gradient reduction]: one bucket's worth
        largest = max((p.numel() for p in params), default=0)
        threshold = int(zero.stage3_param_persistence_threshold)
        kept = sum(p.numel() for p in params if p.numel() <= threshold)
        buffers = max(gathered * p_bytes, pool) + largest * g_bytes + kept * p_bytes
    if stage >= 1 and world_size > 1 and get_accelerator().communication_backend_name() == "gloo":
        # reductions in flight: stage 1 starts every bucket's at the boundary
        flight = -(-psi // max(1, bucket)) if stage == 1 else 2
        # stage 3's pooled buffers share reduce_bucket_size three ways (two in flight)
        one = scratch_bytes(bucket // 3 if stage == 3 else bucket, world_size, c_bytes)
        buffers += min(exchange_budget(), flight * one)
    return JobMemory(states.device, int(activations), int(buffers), states.host)

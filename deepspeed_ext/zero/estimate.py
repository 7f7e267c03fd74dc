"""How much memory ZeRO's model states take per rank, from this runtime's own layout, and
upstream's estimator functions on top (deepspeed.runtime.zero.stage_1_and_2 / .stage3).

[Note: model-state memory] Psi parameters, N data-parallel ranks, P bytes per model
parameter, G per accumulated gradient element, K of optimizer state per parameter (fp32
master, Adam's m and v: 12; 8 for an fp32 model, whose own values are the masters):
  stage 0  params P*Psi      grads G*Psi      optimizer K*Psi
  stage 1  params P*Psi      grads G*Psi      optimizer K*Psi/N
  stage 2  params P*Psi      grads G*Psi/N    optimizer K*Psi/N
  stage 3  params P*Psi/N    grads G*Psi/N    optimizer K*Psi/N, plus the gathered window:
           the largest layer's full parameters and gradients, (P + G) * largest layer.
Offloading the optimizer moves its K*Psi/N and the gradient partitions (kept where the
masters live) to host memory; offloading stage 3's parameters moves P*Psi/N as well.
Building a model without zero.Init holds a full fp32 copy (4*Psi) per process before it is
partitioned. Transient buffers (reduce buckets, receive buffers) and activations are not
model states and are not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelStateMemory:
    """Per-rank bytes: on the device that trains (the GPU, or the CPU of a CPU run), and in
    host memory when offloaded."""

    params: int
    grads: int
    optimizer: int
    window: int  # stage 3's gathered largest layer (params and grads)
    host: int

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer + self.window


def model_param_count(model: nn.Module) -> int:
    """The model's parameters, a shared (tied) one counted once: upstream's
    `deepspeed.runtime.zero.stage_1_and_2.model_to_params`, which returns this int."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[id(p)] = p.numel()
    return sum(seen.values())


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(total parameters, counting shared ones once; the largest layer's own parameters):
    upstream's `deepspeed.runtime.zero.stage3.model_to_params`."""
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return model_param_count(model), largest


def zero_model_state_memory(
    total_params: int,
    world: int,
    stage: int,
    *,
    largest_layer_params: int = 0,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    optimizer_bytes: int | None = None,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> ModelStateMemory:
    """Per-rank model-state bytes of `stage` on `world` data-parallel ranks
    ([Note: model-state memory]). The defaults are a 16-bit model with fp32 gradient
    accumulation and Adam (this runtime's defaults for bf16/fp16)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0, 1, 2 and 3")
    if world < 1:
        raise ValueError(f"world={world}: at least one rank")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs stage 3 (only stage 3 partitions parameters)")
    psi, n = total_params, world
    k = optimizer_bytes if optimizer_bytes is not None else (12 if param_bytes < 4 else 8)
    params = param_bytes * psi / n if stage == 3 else param_bytes * psi
    grads = grad_bytes * psi / n if stage >= 2 else grad_bytes * psi
    optimizer = k * psi / n if stage >= 1 else k * psi
    window = (param_bytes + grad_bytes) * largest_layer_params if stage == 3 else 0
    host = 0.0
    if offload_optimizer:
        host += optimizer
        optimizer = 0
        if stage >= 2:  # the gradient partitions live with the masters
            host += grads
            grads = 0
    if offload_param:
        host += params
        params = 0
    return ModelStateMemory(int(params), int(grads), int(optimizer), int(window), int(host))


# -- upstream's estimator API (same names, arguments and return values) --
def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(bytes per node of CPU memory, bytes per GPU) for ZeRO 2 with mixed-precision Adam.
    The CPU side holds the offloaded states of the node's ranks, and at start each process's
    full fp32 model (4*Psi), times additional_buffer_factor."""
    mem = zero_model_state_memory(
        total_params, num_gpus_per_node * num_nodes, 2, offload_optimizer=cpu_offload
    )
    load = 4 * total_params
    cpu = (mem.host + load) * num_gpus_per_node * additional_buffer_factor
    return int(cpu), mem.device


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(bytes per node of CPU memory, bytes per GPU, the largest layer's gathered bytes) for
    ZeRO 3 with mixed-precision Adam. Without zero_init every process first builds the full
    fp32 model (4*Psi) in CPU memory; with it, only the largest layer."""
    mem = zero_model_state_memory(
        total_params,
        num_gpus_per_node * num_nodes,
        3,
        largest_layer_params=largest_layer_params,
        offload_optimizer=cpu_offload,
        offload_param=cpu_offload and cpu_offload_params,
    )
    load = 4 * (largest_layer_params if zero_init else total_params)
    cpu = (mem.host + load) * num_gpus_per_node * additional_buffer_factor
    return int(cpu), mem.device, mem.window


def _print_table(header: str, rows: list[tuple[int, int, str]]) -> None:
    print(header)
    print("  per CPU  |  per GPU |   Options")
    for cpu, gpu, options in rows:
        print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")


def _hardware(total_params: int, num_gpus_per_node: int, num_nodes: int, extra: str = "") -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params{extra}."
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO 2's model-state memory with and without optimizer offload."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        rows.append((cpu, gpu, f"offload_optimizer={'cpu ' if offload else 'none'}"))
    _print_table(_hardware(total_params, num_gpus_per_node, num_nodes), rows)


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """estimate_zero2_model_states_mem_needs_all_cold for this model's parameter count."""
    total = model_param_count(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print ZeRO 3's model-state memory for each offload and zero.Init choice."""
    rows = []
    for offload in (True, False):
        for offload_params in (True, False) if offload else (False,):
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params,
                    largest_layer_params,
                    num_gpus_per_node,
                    num_nodes,
                    offload,
                    offload_params,
                    zero_init,
                    additional_buffer_factor,
                )
                options = (
                    f"offload_param={'cpu ' if offload_params else 'none'}, "
                    f"offload_optimizer={'cpu ' if offload else 'none'}, "
                    f"zero_init={int(zero_init)}"
                )
                rows.append((cpu, gpu, options))
    extra = f", {int(largest_layer_params / 1e6)}M largest layer params"
    _print_table(_hardware(total_params, num_gpus_per_node, num_nodes, extra), rows)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """estimate_zero3_model_states_mem_needs_all_cold for this model's parameters."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )

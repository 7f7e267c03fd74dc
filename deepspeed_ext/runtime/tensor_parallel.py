"""AutoTP training in the engine: the layout the config asks for, the model sliced before the
gradient strategy is built, and each weight counted once in the gradient norm.

[Note: AutoTP in the engine]
`tensor_parallel.autotp_size` N (or the alias `tensor_model_parallel_size`, or
deepspeed.tp_model_init(model, tp_size=N)) lays the world out as upstream's topology does:
N consecutive ranks slice one replica, the data-parallel groups are the ranks with the same
slice. Everything data-parallel (ZeRO, buckets, batch sizes, the data loader, checkpoints'
dp_rank) then runs over the data group, as with any layout; checkpoints are per
tensor-parallel rank (mp_rank_XX). A sliced weight's gradients differ across the tensor group
and a replicated one's do not, so the norm sums over the tensor group after every rank but the
group's first takes its replicated part away (tp/ cannot import zero/, so that sum lives here).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext import tp
from deepspeed_ext.comm import (
    AxisGroup,
    ParallelLayout,
    ReduceOp,
    all_reduce,
    collective_device,
    group_broadcast,
    layout_from_topology,
    sum_tensor_over,
)
from deepspeed_ext.comm import layout as parallel_layout
from deepspeed_ext.comm.topology import PipeModelDataParallelTopology
from deepspeed_ext.config import ConfigError
from deepspeed_ext.config.batch import BatchSizes
from deepspeed_ext.utils.logging import logger
from deepspeed_ext.zero.norms import sum_of_squares

_KEY = "tensor_parallel.autotp_size"


def set_autotp_mode(training: bool = False) -> None:
    """Upstream's `deepspeed.module_inject.set_autotp_mode`: its switch between AutoTP for
    inference and for training. Here AutoTP is the training kind, applied by
    deepspeed.initialize from the config or tp_model_init, so there is nothing to switch;
    the call stays valid so upstream training scripts run unchanged."""
    if not isinstance(training, bool):
        raise TypeError(f"set_autotp_mode(training=...) takes a bool, got {training!r}")


def tp_model_init(
    model: torch.nn.Module,
    tp_size: int,
    dtype: Any = None,
    config: Any = None,
    tp_group: Any = None,
) -> torch.nn.Module:
    """Upstream's `deepspeed.tp_model_init`: records the tensor-parallel size (and dtype,
    group) on the model for deepspeed.initialize, which does the slicing; returns the model.
    `config` (a DeepSpeed config dict or path, as the Hugging Face integration passes it) is
    only checked: its tensor_parallel.autotp_size, when set, must be tp_size."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    if config is not None:
        from deepspeed_ext.config import parse

        given = parse(config).tensor_parallel.autotp_size
        if given > 1 and given != tp_size:
            raise ValueError(
                f"tp_model_init(tp_size={tp_size}) but the config's {_KEY} is {given}: "
                "make them equal"
            )
    info = {"tp_size": tp_size, "dtype": dtype, "tp_group": tp_group}
    object.__setattr__(model, "ds_autotp_init", info)  # a plain attribute, not a submodule
    return model


def recorded(model: Any) -> dict[str, Any]:
    """What deepspeed.tp_model_init recorded on the model (empty when it was not called)."""
    return dict(getattr(model, "ds_autotp_init", None) or {})


def tp_size(config: Any, model: Any) -> int:
    """The tensor-parallel size: the config's, else tp_model_init's; the two must agree, and
    tp_model_init's dtype must be the one the config trains in."""
    size = max(int(config.tensor_parallel.autotp_size), 1)
    rec = recorded(model)
    if rec.get("tp_size") is None:
        return size
    if size > 1 and rec["tp_size"] != size:
        raise ValueError(
            f"{_KEY} is {size} but deepspeed.tp_model_init(tp_size={rec['tp_size']}) was "
            "called on the model; make them equal or drop one"
        )
    want = (
        torch.float16
        if config.fp16.enabled
        else torch.bfloat16
        if config.bf16.enabled
        else torch.float32
    )
    dtype = rec.get("dtype")
    if dtype is not None and dtype != want:
        raise ValueError(
            f"deepspeed.tp_model_init(dtype={dtype}) but the config trains in {want} "
            "(fp16 / bf16 sections): make them agree"
        )
    return max(size, rec["tp_size"])


def check_rules(config: Any) -> None:
    """tensor_parallel.partition_config and preset_model are checked at initialize even
    when nothing is sliced, so a mistake shows before a larger run (PlanError names it)."""
    cfg = config.tensor_parallel
    if cfg.partition_config is not None:
        tp.plan.from_partition_config(cfg.partition_config)
    if cfg.preset_model is not None:
        tp.plan.preset_rules(cfg.preset_model)  # an unknown name raises, listing the presets


def layout(mpu: Any, size: int, model: Any) -> ParallelLayout:
    """[Note: AutoTP in the engine]: the layout for `size` slices, or the mpu's (checked)."""
    if mpu is not None or size == 1:
        lay = parallel_layout.layout_for(mpu)
        if size > 1 and lay.tensor.size != size:
            raise ValueError(
                f"{_KEY} is {size} but the mpu's tensor-parallel group has {lay.tensor.size} "
                "ranks; make them equal"
            )
        return lay
    world = parallel_layout.world_layout().data.size
    if world % size:
        raise ValueError(
            f"{_KEY} {size} does not divide the world size {world}: launch a multiple of "
            f"{size} ranks, or pick a size that divides {world}"
        )
    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=size, num_dp=world // size)
    lay = layout_from_topology(topo, source=_KEY)
    group = recorded(model).get("tp_group")
    if group is not None and parallel_layout.axis_of(group).ranks != lay.tensor.ranks:
        raise ValueError(
            f"deepspeed.tp_model_init(tp_group=...) holds ranks "
            f"{list(parallel_layout.axis_of(group).ranks)}, but AutoTP lays tensor-parallel "
            f"ranks out consecutively ({list(lay.tensor.ranks)} for this rank): pass the "
            "matching group, or an mpu with your layout to deepspeed.initialize(mpu=...)"
        )
    return lay


def resolve_batch(config: Any, lay: ParallelLayout, size: int, source: str) -> Any:
    """The batch triad over the data-parallel ranks. Under AutoTP, upstream counts every rank
    in train_batch_size (each tensor-parallel rank's copy of a micro-batch too), and the
    Hugging Face Trainer fills it so; such a triad is taken for its micro-batch and
    accumulation, and train_batch_size becomes the data-parallel batch (said once)."""
    try:
        return config.resolve_batch(lay.data.size, source)
    except ConfigError:
        if size == 1:
            raise
        world = lay.data.size * lay.tensor.size * lay.pipe.size
        try:
            counted = config.resolve_batch(world, "the world size (upstream's AutoTP count)")
        except ConfigError:
            raise ConfigError(
                f"the batch sizes fit neither the {lay.data.size} data-parallel ranks nor "
                f"(upstream's AutoTP count) all {world} ranks: with {_KEY} {size}, "
                "train_batch_size = train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x {lay.data.size}"
            ) from None
        sizes = BatchSizes(counted.micro * counted.gas * lay.data.size, counted.micro, counted.gas)
        logger.info(
            f"train_batch_size {counted.train_batch_size} counts each of the {size} "
            f"tensor-parallel ranks (upstream's AutoTP convention); the data-parallel batch "
            f"is {sizes.train_batch_size}"
        )
        return sizes


def slice_for_engine(
    module: torch.nn.Module, config: Any, size: int, tensor: AxisGroup
) -> tp.Sliced | None:
    """Slice the model's layers over the tensor group when AutoTP is asked for (size > 1);
    None otherwise (a Megatron-style mpu's model comes sliced by its own code)."""
    if size == 1:
        return None
    cfg = config.tensor_parallel
    sliced = tp.slice_model(module, tensor, cfg.partition_config, cfg.preset_model)
    _same_random_streams(tensor)
    return sliced


def _same_random_streams(tensor: AxisGroup) -> None:
    """The tensor group's ranks draw the same random numbers from here on: a dropout after a
    row-parallel sum acts on a replicated activation, and different masks on different
    ranks would make the "replicated" weights drift apart silently (seeding each rank
    differently is common in data-parallel scripts)."""
    device = collective_device(tensor)
    state = torch.get_rng_state().to(device)
    group_broadcast(state, tensor)
    torch.set_rng_state(state.cpu())


def norm_axis(module: torch.nn.Module, lay: ParallelLayout) -> AxisGroup:
    """The group the gradient norm's sum of squares runs over after the data group: the
    pipeline stages, and the tensor slices too when the model has sliced weights (marked
    `tensor_model_parallel`, ours or Megatron's). Decided together by the model group (one
    all-reduce at start), so every rank of it runs the same collectives."""
    if lay.tensor.size == 1:
        return lay.pipe
    marked = any(getattr(p, "tensor_model_parallel", False) for p in module.parameters())
    flag = torch.tensor([float(marked)], device=collective_device(lay.model))
    all_reduce(flag, op=ReduceOp.MAX, group=lay.model)
    return lay.model if flag.item() else lay.pipe


def norm_parts(
    module: torch.nn.Module, lay: ParallelLayout
) -> tuple[AxisGroup, list[torch.nn.Parameter]]:
    """(the group the norm's sum runs over after the data group, the params whose squares
    this rank takes away): replicated weights count once, on the tensor group's first rank;
    a pipeline's tied copies on other stages take themselves away already."""
    axis = norm_axis(module, lay)
    if axis is not lay.model or lay.tensor.rank == 0:
        return axis, []
    replicated = tp.replicated_params(module)
    return axis, [p for p in replicated if not getattr(p, "ds_pipe_replicated", False)]


def replicated_grad_sq(
    strategy: Any, params: list[torch.nn.Parameter], data: AxisGroup, device: torch.device
) -> torch.Tensor:
    """sum(g^2) over `params`' gradients, whole (summed over the data group when ZeRO holds
    them in partitions). Collective over `data`: every data-parallel rank calls it."""
    parts = []
    for p in params:
        found = strategy.fragment_owner(p, "grad")
        if found is None or found[1] is None:
            continue
        frag, owner = found
        lo, hi = frag.local_range()
        parts.append(owner.reshape(-1)[lo:hi])
    sq = sum_of_squares(parts, device)
    return sum_tensor_over(sq, data) if strategy.partitioned_grads else sq

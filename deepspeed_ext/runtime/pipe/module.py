"""PipelineModule: a model given as a sequence of layers, cut into pipeline stages.

Each rank builds only its stage's layers (LayerSpecs are built where they are owned), names
them by their global layer index as upstream does (state-dict keys like "3.weight"), and
keeps the modules of TiedLayerSpecs in `tied_modules` (one per key per stage: every use on
this stage shares it). Tied weights start equal on every stage holding them (a broadcast
from the first such stage); their gradients are summed over the stages holding them at each
step ([Note: tied weights] in pipe/tied.py).
"""

from __future__ import annotations

import functools
import glob
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.comm import PipelineParallelGrid, ProcessTopology
from deepspeed_ext.comm.topology import PipeDataParallelTopology

from ..checkpoint.checkpoint_engine import CheckpointEngine, TorchCheckpointEngine
from . import layer_files
from .partition import partition_layers
from .spec import LayerSpec, TiedLayerSpec
from .tied import TiedWeights


def _default_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """The default activation_checkpoint_func: deepspeed.checkpointing's non-reentrant
    checkpoint, so the activation_checkpointing section (cpu_checkpointing, profile, the RNG
    tracker) applies, and the zb-h1 schedule can split the recompute's backward. With
    partition_activations on, the reentrant one (upstream's default): it keeps 1/tp of each
    saved input where torch's non-reentrant checkpoint keeps them whole, which would leave
    the key unheeded (zb-h1 then runs those backwards whole, and says so)."""
    from ..activation_checkpointing import settings

    if settings.current().partition_activations:
        return _reentrant_checkpoint(function, *args)
    return _reentrant_free_checkpoint(function, *args)


def _reentrant_free_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """pipeline.use_reentrant false: deepspeed.checkpointing's non-reentrant checkpoint."""
    from ..activation_checkpointing.function import non_reentrant_checkpoint

    return non_reentrant_checkpoint(function, *args)


def _reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """pipeline.use_reentrant true: deepspeed.checkpointing.checkpoint, upstream's default
    (partition_activations splits its inputs; zb-h1 cannot split it, so it runs whole)."""
    from ..activation_checkpointing.function import checkpoint

    return checkpoint(function, *args)


# models checkpointed by layer class name alone (_is_checkpointable), as upstream does
_MEGATRON_PIPES = ("GPTModelPipe", "GPT2ModelPipe")

# pipeline.use_reentrant's value -> the module's activation_checkpoint_func
DEFAULT_CHECKPOINTS = {
    None: _default_checkpoint,
    False: _reentrant_free_checkpoint,
    True: _reentrant_checkpoint,
}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class PipelineModule(torch.nn.Module):
    # how virtual stages sit on the ranks (checkpoints record it): chunk c of rank r is
    # virtual stage c * num_stages + r
    pipe_layout = "interleaved"

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: Any = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = _default_checkpoint,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("PipelineModule(layers=[]): give at least one layer")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, torch.nn.Module)) or callable(layer)):
                raise TypeError(
                    f"PipelineModule layer {i} is a {type(layer).__name__}: layers are "
                    "LayerSpecs, torch.nn.Modules or callables"
                )
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
            raise TypeError(
                f"virtual_stages={virtual_stages!r}: give an int (1, or 2+ model chunks per rank)"
            )
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages}: use 1, or 2+ model chunks per rank")
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval={activation_checkpoint_interval}: use 0 (off) "
                "or a positive number of layers per checkpoint"
            )
        comm.init_distributed(verbose=False)
        self.world_size = comm.get_world_size()
        self.global_rank = comm.get_rank()
        # upstream's: the data-parallel ranks of a stage share writing its layer files
        # (the engine sets it from checkpoint.parallel_write.pipeline_stage)
        self.checkpoint_parallel_write_pipeline = False
        self._topo = self._topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        if virtual_stages > 1 and self.num_stages < 2:
            raise ValueError(
                f"{type(self).__name__} with {virtual_stages} model chunks per rank spreads "
                "them over pipeline stages: it needs num_stages >= 2"
            )
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = layers
        # interleaving (ours): num_stages * virtual_stages parts; this rank holds the parts
        # of virtual stages c * num_stages + stage_id, one model chunk each
        self.virtual_stages = virtual_stages
        self.parts = partition_layers(
            layers, self.num_stages * virtual_stages, partition_method, virtual_stages
        )
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._grid.get_stage_id()
        self.chunk_ranges = [
            (self.parts[v], self.parts[v + 1])
            for v in (self.chunk_stage(c) for c in range(virtual_stages))
        ]
        self._local_start, self._local_stop = self.chunk_ranges[0]
        self._num_layers = len(self._layer_specs)  # upstream's name, read by subclasses
        self.micro_offset = 0
        self.forward_funcs: list[Callable[..., Any]] = []
        self.chunk_funcs: list[list[Callable[..., Any]]] = []
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        self.tied = TiedWeights(self, self._grid)

    def _topology(
        self, num_stages: int | None, topology: ProcessTopology | None
    ) -> ProcessTopology:
        if topology is not None:
            stages = topology.get_dim("pipe")
            if num_stages is not None and num_stages != stages:
                raise ValueError(
                    f"PipelineModule(num_stages={num_stages}) disagrees with the topology's "
                    f"{stages} pipe stages: pass one of them"
                )
            return topology
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages=<int> or topology=<ProcessTopology>")
        if num_stages < 1 or self.world_size % num_stages:
            raise ValueError(
                f"num_stages={num_stages} does not divide the world size {self.world_size}: "
                "launch a multiple of num_stages ranks (the rest are data-parallel replicas), "
                "or change num_stages"
            )
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)

    # -- which rank holds which part: interleaved (ours) places virtual stage c * p + r on
    # rank r as its chunk c; DualPipeVModule overrides these two for its V
    def chunk_stage(self, chunk: int, stage_id: int | None = None) -> int:
        """The virtual stage (index into the parts) of model chunk `chunk` on pipeline stage
        `stage_id` (this rank's by default)."""
        s = self.stage_id if stage_id is None else stage_id
        return chunk * self.num_stages + s

    def stage_chunk(self, virtual_stage: int) -> tuple[int, int]:
        """The (pipeline stage, model chunk) holding a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages

    @property
    def loss_stage_id(self) -> int:
        """The pipeline stage holding the model's last layers (it computes the loss)."""
        return self.stage_chunk(self.num_stages * self.virtual_stages - 1)[0]

    def chunk_trains(self, chunk: int = 0) -> bool:
        """Whether model chunk `chunk`'s layers hold a parameter that requires a gradient."""
        for fn in self.chunk_funcs[chunk]:
            if isinstance(fn, functools.partial) and fn.args:
                fn = fn.args[0]  # a tied layer's forward_fn over its module
            if isinstance(fn, torch.nn.Module) and any(p.requires_grad for p in fn.parameters()):
                return True
        return False

    def local_layer_indices(self) -> list[int]:
        """Global indices of this rank's layers, chunk by chunk."""
        return [i for lo, hi in self.chunk_ranges for i in range(lo, hi)]

    def _build(self) -> None:
        for lo, hi in self.chunk_ranges:
            start = len(self.forward_funcs)
            for idx in range(lo, hi):
                self._build_layer(idx)
            self.chunk_funcs.append(self.forward_funcs[start:])

    def _build_layer(self, idx: int) -> None:
        layer = self._layer_specs[idx]
        if self.seed_layers:
            (self.seed_fn or _seed_everything)(self.base_seed + idx)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            fn = module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
            self.forward_funcs.append(fn)
        elif isinstance(layer, LayerSpec):
            module = layer.build()
            self.add_module(str(idx), module)
            self.forward_funcs.append(module)
        elif isinstance(layer, torch.nn.Module):
            self.add_module(str(idx), layer)
            self.forward_funcs.append(layer)
        else:
            self.forward_funcs.append(layer)

    # -- forward --
    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """This rank's layers (of model chunk `chunk` when interleaved)."""
        self.micro_offset += 1
        funcs = self.chunk_funcs[chunk]
        first = self.chunk_ranges[chunk][0]  # the chunk's first global layer index
        every = self.activation_checkpoint_interval
        if every == 0 or not torch.is_grad_enabled():
            return self._run(funcs, 0, len(funcs), first)(forward_input)
        x = forward_input
        for start in range(0, len(funcs), every):
            end = min(start + every, len(funcs))
            run = self._run(funcs, start, end, first)
            if self._is_checkpointable(funcs[start:end]):
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(x)
        return x

    def _run(
        self, funcs: list[Callable[..., Any]], start: int, end: int, first: int
    ) -> Callable[..., Any]:
        """funcs[start:end] in turn. With seed_layers, as upstream: each layer's random state
        (dropout) is seeded from the micro-batch's forward count and its global index, fixed
        when the forward began, so a recompute (activation checkpointing) draws the same.
        Under activation checkpointing upstream restarts the index in every segment (its
        segments repeat the first one's seeds); here each layer keeps its own."""
        offset = self.micro_offset + 1
        seed = (self.seed_fn or _seed_everything) if self.seed_layers else None

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for idx, f in enumerate(funcs[start:end], first + start):
                if seed is not None:
                    seed(self.base_seed * offset + idx)
                x = f(x)
            return x

        return run

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if type(self).__name__ in _MEGATRON_PIPES and not self._checkpoints_non_reentrant():
            # Megatron-DeepSpeed's GPT pipes, as upstream treats them: transformer layers
            # (and checkpointable_layers), never the embedding, mask helpers or the head
            extra = self.checkpointable_layers or []
            return all(
                "ParallelTransformerLayerPipe" in type(f).__name__ or type(f).__name__ in extra
                for f in funcs
            )
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(
            isinstance(f, torch.nn.Module) and any(True for _ in f.parameters()) for f in funcs
        )

    def _checkpoints_non_reentrant(self) -> bool:
        from ..activation_checkpointing.function import non_reentrant_checkpoint

        func = self.activation_checkpoint_func
        return func in (_reentrant_free_checkpoint, non_reentrant_checkpoint)

    # -- upstream's queries --
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer {layer_idx} is not in this model's {len(self._layer_specs)}")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return self.stage_chunk(part)[0]
        raise AssertionError("unreachable: parts cover every layer")

    def partitions(self) -> list[int]:
        return list(self.parts)

    # -- upstream's checkpoint hooks: a subclass may override them ([Note: layer file hooks])
    def ckpt_prefix(self, checkpoints_path: str, tag: Any) -> str:
        """A prefix for this rank's files: "<path>/<tag>/module-pipe_01-model_00"-style (the
        data axis left out: its ranks hold the same layers)."""
        axes = self._topo.get_rank_repr(self.global_rank, omit_axes=("data",))
        return os.path.join(checkpoints_path, str(tag), "module" + (f"-{axes}" if axes else ""))

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """The file of this rank's local_layer_idx-th layer (upstream's name, by the layer's
        global index)."""
        idx = self.local_layer_indices()[local_layer_idx]
        return os.path.join(ckpt_dir, layer_files.layer_file(self, idx))

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every file of that layer in ckpt_dir (one per tensor-parallel rank), sorted."""
        idx = self.local_layer_indices()[local_layer_idx]
        return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{idx:02d}-*model_states.pt")))

    def save_state_dict(
        self,
        save_dir: str,
        checkpoint_engine: CheckpointEngine | None = None,
        exclude_frozen_params: bool = False,
    ) -> None:
        """Write this rank's layer files into save_dir: data-parallel rank 0 writes them all,
        or with checkpoint_parallel_write_pipeline each data-parallel rank its share."""
        files = checkpoint_engine or TorchCheckpointEngine()
        layer_files.save_layers(self, save_dir, files, exclude_frozen_params)

    def load_state_dir(
        self, load_dir: str, checkpoint_engine: CheckpointEngine | None = None, strict: bool = True
    ) -> None:
        """Load this rank's layers from the layer files in load_dir (a checkpoint's tag
        directory), e.g. pretrained weights before training."""
        files = checkpoint_engine or TorchCheckpointEngine()
        layer_files.load_layers(self, load_dir, files, strict)

    def set_checkpoint_interval(self, interval: int) -> None:
        self.activation_checkpoint_interval = interval

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the tied weights' .grad over the stages holding them (for code that keeps
        grads on the params; the engine sums them where its strategy keeps them)."""
        self.tied.allreduce_param_grads()

    @property
    def tied_comms(self) -> dict[str, dict[str, Any]]:
        """Upstream's index of this stage's tied keys that other stages hold too (code that
        counts tied weights once, or sums their gradients, reads it): the global ranks
        holding each, by stage, their process group, the weight attributes and the tied
        module. A key on this stage alone is left out, as get_tied_weights_and_groups()
        leaves it (there is nothing to sum it with)."""
        return {
            key: {
                "ranks": list(group.ranks),
                "group": group.group,
                "weight_attr": list(self.tied_weight_attrs[key]),
                "module": self.tied_modules[key],
            }
            for key, _, group in self.tied.entries()
            if group.size > 1
        }

    def _synchronize_tied_weights(self) -> None:
        """Upstream's: each tied weight broadcast from the first stage holding it."""
        self.tied.synchronize()

    def get_tied_weights_and_groups(self) -> list[tuple[torch.nn.Parameter, Any]]:
        """Upstream's: each tied weight and the torch process group of the stages holding
        it, for code that sums their gradients itself. A key that one stage holds alone has
        nothing to sum and is left out (its group of one would read as the whole world to
        torch.distributed)."""
        return [(p, g.group) for _, params, g in self.tied.entries() for p in params if g.size > 1]

    def get_additional_losses(self) -> Any:
        """Upstream's hook: override it to return {name: loss tensor} after each forward
        (MoE auxiliary losses and the like); the engine averages them over the batch and
        the data-parallel ranks into engine.agg_additional_losses on every stage, and
        prints scalar ones on the metrics line ([Note: additional losses]). Only the last
        stage's are read."""
        return None

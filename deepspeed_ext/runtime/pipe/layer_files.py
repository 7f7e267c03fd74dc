"""A pipeline checkpoint's per-layer files: their names, and the defaults of upstream's
PipelineModule hooks that write and read them.

[Note: layer file hooks]
Upstream's PipelineModule has five checkpoint hooks: ckpt_prefix, ckpt_layer_path(dir, local
index), ckpt_layer_path_list, save_state_dict(dir, checkpoint_engine, exclude_frozen_params)
and load_state_dir(dir, checkpoint_engine, strict). Models subclass it to rename the layer
files or to load pretrained weights their own way. Here too the engine's save_checkpoint
calls module.save_state_dict on every rank to write the layer files (the default picks the
writers among a stage's data-parallel ranks; checkpoint.parallel_write.pipeline_stage
shares them out), and every layer file is found
through module.ckpt_layer_path, so an override of either is honoured. On load, a class that
overrides load_state_dir has it called (with load_checkpoint's load_module_strict); what it
leaves in the module is the module state the strategy then loads (and syncs its fp32 masters
from). Without an override the engine reads the layer files itself (as the default would,
through ckpt_layer_path). Resuming at another number of stages reads the other stages' files
by their default names (it needs layers this rank never held under its own indices).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.utils.splits import partition_uniform

from ..checkpoint import clone_tensors_for_torch_save
from ..checkpoint.checkpoint_engine import CheckpointEngine
from .spec import TiedLayerSpec

if TYPE_CHECKING:
    from .module import PipelineModule


def layer_file(module: PipelineModule, idx: int) -> str:
    """The default name of global layer idx's file on this rank (upstream's)."""
    rank_repr = module.topology().get_rank_repr(module.global_rank)
    return f"layer_{idx:02d}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"


def local_layers(module: PipelineModule) -> list[tuple[int, int, torch.nn.Module, str]]:
    """(local index, global index, module, its state-dict prefix in the PipelineModule) per
    local layer that has state. The local index counts this rank's layers (forward_funcs),
    as upstream's ckpt_layer_path takes it; a tied module is saved under every index that
    uses it."""
    out = []
    for local, (idx, fn) in enumerate(zip(module.local_layer_indices(), module.forward_funcs)):
        spec = module._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            out.append((local, idx, module.tied_modules[spec.key], f"tied_modules.{spec.key}."))
        elif isinstance(fn, torch.nn.Module):
            out.append((local, idx, fn, f"{idx}."))
    return out


def save_layers(
    module: PipelineModule, save_dir: str, files: CheckpointEngine, exclude_frozen: bool
) -> None:
    """save_state_dict's default: one file per local layer with state, at
    module.ckpt_layer_path. The data-parallel ranks of a stage hold the same layers: rank 0
    writes them all, or with checkpoint_parallel_write_pipeline each rank writes an even
    share of the stage's layers (upstream's cut)."""
    grid = module.mpu()
    dp_rank, dp_size = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    if module.checkpoint_parallel_write_pipeline:
        cuts = partition_uniform(len(module.forward_funcs), dp_size)
        mine = range(cuts[dp_rank], cuts[dp_rank + 1])
    elif files.is_data_parallel_writer(dp_rank):
        mine = range(len(module.forward_funcs))
    else:
        return
    files.makedirs(save_dir, exist_ok=True)
    for local, _, layer, _ in local_layers(module):
        if local not in mine:
            continue
        sd = layer.state_dict()
        if exclude_frozen:
            frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        if files.preserves_storage_sharing():
            sd = clone_tensors_for_torch_save(sd)
        files.save(sd, module.ckpt_layer_path(save_dir, local))


def layer_path(module: PipelineModule, ckpt_dir: Path, local: int, idx: int) -> Path:
    """Where a local layer's file is: module.ckpt_layer_path's, or for a tied layer without
    a file of its own (upstream writes none for a forward_fn use) its key's first file."""
    f = Path(module.ckpt_layer_path(str(ckpt_dir), local))
    spec = module._layer_specs[idx]
    if not f.exists() and isinstance(spec, TiedLayerSpec):
        f = ckpt_dir / layer_file(module, tied_file_index(ckpt_dir, module, spec.key))
    return f


def load_layers(
    module: PipelineModule, load_dir: str, files: CheckpointEngine, strict: bool
) -> None:
    """load_state_dir's default: each local layer from its file."""
    for local, idx, layer, _ in local_layers(module):
        path = layer_path(module, Path(load_dir), local, idx)
        sd = files.load(str(path))
        try:
            layer.load_state_dict(sd, strict=strict)
        except RuntimeError as e:  # torch names the keys, not the file
            raise CheckpointError(f"{path} does not fit layer {idx}: {e}") from None


def tied_file_index(ckpt_dir: Path, module: PipelineModule, key: str) -> int:
    """Every use of a tied key is saved: the first one's file."""
    uses = [i for i, s in enumerate(module._layer_specs) if isinstance(s, TiedLayerSpec)]
    uses = [i for i in uses if module._layer_specs[i].key == key]
    for i in uses:
        if (ckpt_dir / layer_file(module, i)).exists():
            return i
    names = ", ".join(layer_file(module, i) for i in uses)
    raise CheckpointError(
        f"{ckpt_dir} has no layer file for the tied weights {key!r} (none of {names})"
    )

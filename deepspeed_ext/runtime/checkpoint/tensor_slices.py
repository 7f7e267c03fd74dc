"""Checkpoints under tensor slicing: resumable at another tensor-parallel size.

[Note: AutoTP checkpoints]
Each tensor-parallel rank's data-parallel rank 0 writes `mp_rank_XX_model_states.pt` (its
slices) and the ZeRO rank files of its data group, as any model-parallel rank does; the
model-states file adds `tensor_parallel`: the size, the slice table ([Note: tensor-slice
table]) and the names of each optimizer group's params. Loading at the same size reads this
rank's files. At another size (including 1 to N and N to 1) every saved rank's weights and
optimizer state are read by parameter name ([Note: named optimizer state]), sliced ones made
whole from the saved table, and cut again for this rank by the current layers' slices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import tp
from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.zero.named_state import NamedState, from_stage0, from_zero, is_per_element

from .layout import model_states_name
from .safe_load import load as load_state_file


def saved_info(engine: Any) -> dict[str, Any]:
    names = getattr(engine.strategy, "param_names", None)
    return {
        "size": engine.layout.tensor.size,
        "slices": tp.slice_table(engine.module),
        "param_names": names() if names is not None else None,
    }


def saved_size(state: dict[str, Any]) -> int:
    return int((state.get("tensor_parallel") or {}).get("size", 1))


def saved_tensor_size(state: dict[str, Any]) -> int:
    """The tensor-parallel size a pipeline checkpoint was saved at ([Note: pipeline
    checkpoint]; older files: from the AutoTP slice table; upstream's: its recorded
    tp_degree; else 1)."""
    size = (state.get("pipeline") or {}).get("tensor_size")
    if size is None:
        size = (state.get("tensor_parallel") or {}).get("size")
    if size is None:
        size = (state.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1)
    return int(size)


def stage_file_rank(stage: int, tensor_rank: int, tensor_size: int) -> int:
    """The model-parallel rank whose files hold a saved stage's tensor slice."""
    return stage * tensor_size + tensor_rank


def _table(state: dict[str, Any]) -> dict[str, list[Any]]:
    return dict((state.get("tensor_parallel") or {}).get("slices") or {})


def whole_value(name: str, values: list[torch.Tensor], table: dict[str, list[Any]]) -> torch.Tensor:
    """One parameter's value (any shape) from every saved rank's: whole again when sliced."""
    if name not in table:
        return values[0]
    spec = tp.spec_from_table(table[name])
    return spec.full([v.reshape(spec.local_shape) for v in values])


def _mine(name: str, whole: torch.Tensor, module_params: dict[str, Any]) -> torch.Tensor:
    """This rank's cut of a whole value, by the current layer's slice (flat in, flat out
    when the input was flat)."""
    p = module_params.get(name)
    spec = getattr(p, "ds_tensor_slice", None)
    if spec is None:
        return whole
    local = spec.local(whole.reshape(spec.full_shape))
    return local.reshape(-1) if whole.dim() == 1 else local


def _saved_states(ckpt_dir: Path, read: dict[str, Any], read_name: str) -> list[dict[str, Any]]:
    """Every saved model-parallel rank's model-states file, in rank order; `read` (the file
    named `read_name`) is not read again."""
    return [
        read
        if model_states_name(k) == read_name
        else load_state_file(ckpt_dir / model_states_name(k))
        for k in range(saved_size(read))
    ]


def state_to_load(
    engine: Any, ckpt_dir: Path, path: Path
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """(the model-states dict for this rank, every saved rank's model-states file when the
    checkpoint was saved at another tensor-parallel size, else None). Each file is read
    once; load_optimizer takes the list."""
    here = engine.layout.tensor.size
    # the model slices itself (a Megatron-style mpu, no AutoTP): each model-parallel rank's
    # file is its own slices, which only the model knows how to cut again
    own_slicing = here > 1 and getattr(engine, "autotp", None) is None
    if here > 1 and not path.exists():
        if own_slicing:
            raise CheckpointError(
                f"{path} is missing: {ckpt_dir} was saved at another model-parallel size "
                f"than this run's {here}. A model sliced by its own layers (mpu=...) resumes "
                "only at the model-parallel size that saved it"
            )
        path = ckpt_dir / model_states_name(0)  # saved with fewer slices
    state = load_state_file(path)
    if saved_size(state) == here or (own_slicing and "tensor_parallel" not in state):
        return state, None
    saved = _saved_states(ckpt_dir, state, path.name)
    return state_for_load(engine, saved), saved


def state_for_load(engine: Any, saved: list[dict[str, Any]]) -> dict[str, Any]:
    """The model-states dict for this rank from a checkpoint saved at another tensor-parallel
    size (`saved`: every saved rank's file): its module made whole and cut for this rank."""
    first = saved[0]
    table = _table(first)
    params = dict(engine.module.named_parameters(remove_duplicate=False))  # tied names too
    module = {}
    for name in first["module"]:
        whole = whole_value(name, [s["module"][name] for s in saved], table)
        module[name] = _mine(name, whole, params).clone()
    return {**first, "module": module}


def load_optimizer(engine: Any, ckpt_dir: Path, saved: list[dict[str, Any]], reader: Any) -> None:
    """Optimizer state and masters by name from every saved rank (`saved`: their
    model-states files), re-cut for this one. reader(dir, mp_rank): the ZeRO rank files of a
    saved model-parallel rank."""
    stage = engine.zero_optimization_stage()
    table = _table(saved[0])
    per_rank = []
    for k, state in enumerate(saved):
        if int(state.get("zero_stage") or 0) != stage:
            raise CheckpointError(
                f"{ckpt_dir} was written with zero_optimization.stage {state.get('zero_stage')} "
                f"and this run uses {stage}: resume with the same stage, or pass "
                "load_optimizer_states=False"
            )
        if stage == 0:
            names = (state.get("tensor_parallel") or {}).get("param_names")
            names = names or engine.strategy.param_names()
            per_rank.append(from_stage0(state, names, state["module"]))
        else:
            per_rank.append(from_zero(reader(ckpt_dir, k)))
    params = dict(engine.module.named_parameters(remove_duplicate=False))  # tied names too
    out = NamedState()
    for name, master in per_rank[0].masters.items():
        whole = whole_value(name, [n.masters[name] for n in per_rank], table)
        out.masters[name] = _mine(name, whole.reshape(-1), params)
        numel = master.numel()
        out.state[name] = {}
        for key, value in per_rank[0].state.get(name, {}).items():
            if is_per_element(key, value, numel):
                whole = whole_value(name, [n.state[name][key] for n in per_rank], table)
                value = _mine(name, whole.reshape(-1), params)
            out.state[name][key] = value
        out.options[name] = per_rank[0].options.get(name, {})
    engine.strategy.load_named_state(engine.optimizer, out, ckpt_dir)

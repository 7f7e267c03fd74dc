"""Pipeline checkpoints in upstream's layout, resumable at another number of stages.

[Note: pipeline checkpoint]
Each stage writes one file per layer it owns, `layer_XX-model_states.pt` (XX the global
layer index; the layer's own state dict; a tied module under every layer index that uses
it), through the module's save_state_dict ([Note: layer file hooks]: data-parallel rank 0,
or with checkpoint.parallel_write.pipeline_stage each data-parallel rank a share), and its
data-parallel rank 0 writes `mp_rank_XX_model_states.pt` (XX the stage; under tensor
slicing stage x tensor size + tensor rank, each tensor rank's layer files named by it)
with module=None, the engine's counters, scheduler and loss scaler, and a `pipeline`
entry: the stage count, the partition and the names of each optimizer group's params.
ZeRO rank files are as without a pipeline, one set per stage.
Loading at the same stage count reads this stage's files (another data-parallel size is
re-cut as usual). At another stage count each stage assembles its module from the layer
files of the layers it now owns and its optimizer state by parameter name from every saved
stage's files ([Note: named optimizer state]); layer names are global, so they do not depend
on the partition.

[Note: upstream pipeline checkpoints] A checkpoint written by upstream's PipelineEngine has
the same layer files (but none for a tied layer used through forward_fn: its key's other
use holds the weights) and per-stage files without the `pipeline` entry or any partition.
It loads here: the module from the layer files at any number of stages; the counters from
the stage files; the optimizer state (stage 0: a torch state dict per stage, by position)
only at the saved number of stages, only if it is a plain torch optimizer's, its parameter
groups hold as many parameters as this stage's optimizer's, and every saved state tensor has
the shape of the parameter at its position (this engine orders a stage's parameters as
upstream's: tied modules first, then the layers); else an error that names
load_optimizer_states=False. Upstream's ZeRO-partitioned or fp16-wrapped state is refused
alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.zero.named_state import NamedState, from_stage0, from_zero

from ..checkpoint import RankFileReader, load_state_file
from ..checkpoint.layout import model_states_name
from ..checkpoint.tensor_slices import saved_tensor_size, stage_file_rank
from .layer_files import layer_file, layer_path, local_layers, tied_file_index
from .module import PipelineModule

if TYPE_CHECKING:
    from .engine import PipelineEngine


def _module(engine: PipelineEngine) -> PipelineModule:
    return cast("PipelineModule", engine.module)


def write_layers(engine: PipelineEngine, tmp: Path, exclude_frozen: bool) -> None:
    """Every rank: the module writes its layer files ([Note: layer file hooks]: a
    subclass's save_state_dict if it has one)."""
    module = _module(engine)
    module.save_state_dict(str(tmp), engine.checkpoint_engine, exclude_frozen_params=exclude_frozen)


def extras(engine: PipelineEngine) -> dict[str, Any]:
    module = _module(engine)
    names = getattr(engine.strategy, "param_names", None)
    return {
        "module": None,
        "pipeline": {
            "num_stages": module.num_stages,
            "virtual_stages": module.virtual_stages,
            "layout": module.pipe_layout,
            "parts": [int(x) for x in module.parts],
            "param_names": names() if names is not None else None,
            # each stage's files come in tensor_size slices, model-parallel rank
            # stage * tensor_size + tensor_rank (the layout's replica order)
            "tensor_size": engine.layout.tensor.size,
            "tensor_rank": engine.layout.tensor.rank,
            # global layer index -> its state-dict prefix (zero_to_fp32 names by it)
            "layer_prefixes": {str(i): prefix for _, i, _, prefix in local_layers(module)},
        },
    }


def module_from_layers(module: PipelineModule, ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """This stage's module state, from the layer files of the layers it owns now."""
    out: dict[str, torch.Tensor] = {}
    for local, idx, _, prefix in local_layers(module):
        sd = load_state_file(layer_path(module, ckpt_dir, local, idx))
        out.update({prefix + k: v for k, v in sd.items()})
    return out


def _module_state(engine: PipelineEngine, ckpt_dir: Path, strict: bool) -> dict[str, torch.Tensor]:
    """The module state to load: read from the layer files, or, when the module's class
    overrides load_state_dir, what that left in the module ([Note: layer file hooks])."""
    module = _module(engine)
    if type(module).load_state_dir is PipelineModule.load_state_dir:
        return module_from_layers(module, ckpt_dir)
    module.load_state_dir(str(ckpt_dir), engine.checkpoint_engine, strict=strict)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _written_upstream(first: dict[str, Any], ckpt_dir: Path) -> bool:
    """Upstream's PipelineEngine wrote it ([Note: upstream pipeline checkpoints])."""
    return first.get("module", 0) is None and any(ckpt_dir.glob("layer_*-model_states.pt"))


def state_for_load(
    engine: PipelineEngine, ckpt_dir: Path, path: Path, strict: bool
) -> dict[str, Any]:
    first = load_state_file(ckpt_dir / model_states_name(0))
    engine._ckpt_upstream = "pipeline" not in first and _written_upstream(first, ckpt_dir)
    if "pipeline" in first:
        saved = first["pipeline"]
        stages = (
            int(saved["num_stages"]),
            int(saved.get("virtual_stages", 1)),
            str(saved.get("layout", "interleaved")),
        )
    elif engine._ckpt_upstream:
        dims = first.get("checkpoint_parallel_dimensions") or {}
        stages = (int(dims.get("pp_degree", first.get("mp_world_size", 1))), 1, "interleaved")
    else:
        raise CheckpointError(
            f"{ckpt_dir} was not written by a pipeline engine (no per-layer files): load it "
            "into the model it was saved from, or consolidate it with zero_to_fp32"
        )
    tensor = saved_tensor_size(first)
    if tensor != engine.layout.tensor.size:
        raise CheckpointError(
            f"{ckpt_dir} was saved at tensor-parallel size {tensor} and this run has "
            f"{engine.layout.tensor.size}: a pipeline checkpoint resumes at any number of "
            "stages and data-parallel ranks, but at the tensor-parallel size that saved it; "
            f"resume with tensor_parallel.autotp_size {tensor}"
        )
    module = _module(engine)
    # the same cut too: another partition_method at the same stage count puts other layers
    # on each rank, whose optimizer state must be re-cut by name like a stage-count change
    saved_parts = first.get("pipeline", {}).get("parts")
    same_cut = saved_parts is None or [int(x) for x in saved_parts] == [
        int(x) for x in module.parts
    ]
    same = same_cut and stages == (engine.num_stages, module.virtual_stages, module.pipe_layout)
    state = load_state_file(path) if same else dict(first)
    state["module"] = _module_state(engine, ckpt_dir, strict)
    engine._ckpt_same_layout = same
    return state


def load_optimizer(engine: PipelineEngine, state: dict[str, Any], files: Any) -> None:
    if engine._ckpt_upstream:
        _load_upstream_optimizer(engine, state, Path(files.where))
        return
    if engine._ckpt_same_layout:
        engine.strategy.load_optimizer_state(engine.optimizer, state, files)
        return
    ckpt_dir = Path(files.where)
    saved_stages = int(state["pipeline"]["num_stages"])
    size, t = saved_tensor_size(state), engine.layout.tensor.rank  # the same size (above)
    named = NamedState()
    for k in range(saved_stages):
        rank = stage_file_rank(k, t, size)
        mine = load_state_file(ckpt_dir / model_states_name(rank))
        if int(mine["pipeline"].get("tensor_rank", t)) != t:
            raise CheckpointError(
                f"{ckpt_dir / model_states_name(rank)} holds tensor-parallel rank "
                f"{mine['pipeline']['tensor_rank']}'s slices, not {t}'s: the checkpoint's "
                "ranks were laid out otherwise than stage-major; load_optimizer_states=False "
                "takes the weights only"
            )
        if int(mine.get("zero_stage") or 0) != engine.zero_optimization_stage():
            raise CheckpointError(
                f"{ckpt_dir} was written with zero_optimization.stage {mine.get('zero_stage')} "
                f"and this run uses {engine.zero_optimization_stage()}: resume with the same "
                "stage, or pass load_optimizer_states=False"
            )
        if int(mine.get("zero_stage") or 0) == 0:
            weights = _saved_stage_weights(ckpt_dir, mine, _module(engine))
            named.update(from_stage0(mine, mine["pipeline"]["param_names"], weights))
        else:
            named.update(from_zero(RankFileReader(ckpt_dir, rank)))
    engine.strategy.load_named_state(engine.optimizer, named, ckpt_dir)


def _load_upstream_optimizer(engine: PipelineEngine, state: dict[str, Any], where: Path) -> None:
    """Upstream's stage-0 optimizer state of this stage, by position, where it provably
    belongs to these parameters ([Note: upstream pipeline checkpoints])."""
    saved = state.get("optimizer")

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"{where} was written by upstream DeepSpeed's pipeline engine and its optimizer "
            f"state cannot be placed here: {why}. Load it with load_optimizer_states=False "
            "(the weights and counters load; the optimizer starts afresh)"
        )

    if engine.zero_optimization_stage() != 0:
        raise refuse("this run uses ZeRO, whose optimizer state is laid out otherwise")
    if not (isinstance(saved, dict) and "state" in saved and "param_groups" in saved):
        raise refuse(
            "it is not a plain torch optimizer's state (ZeRO-partitioned, fp16/bf16-wrapped, "
            "or absent)"
        )
    if not engine._ckpt_same_layout:
        raise refuse(f"it was saved at another number of stages than {engine.num_stages}")
    # torch numbers the parameters across the groups in order; so does its load_state_dict
    groups = engine.optimizer.param_groups
    counts = [len(g["params"]) for g in groups]
    theirs = [len(g["params"]) for g in saved["param_groups"]]
    if counts != theirs:
        raise refuse(
            f"its parameter groups hold {theirs} parameters and this stage's optimizer {counts}"
        )
    ours = [p for g in groups for p in g["params"]]
    for i, st in saved["state"].items():
        shapes = {tuple(v.shape) for v in st.values() if torch.is_tensor(v) and v.dim()}
        if not 0 <= int(i) < len(ours) or shapes - {tuple(ours[int(i)].shape)}:
            raise refuse(
                f"the state of its parameter {i} does not fit this stage's parameter there "
                "(another partition of the layers, or another optimizer)"
            )
    engine.optimizer.load_state_dict(saved)
    engine.strategy.sync_masters_from_model()


def _saved_stage_weights(
    ckpt_dir: Path, saved: dict[str, Any], module: PipelineModule
) -> dict[str, torch.Tensor]:
    """The weights a saved stage held, by name (the masters of an fp32 model)."""
    names = [n for group in saved["pipeline"]["param_names"] for n in group]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            key, _, rest = rest.partition(".")
            idx = tied_file_index(ckpt_dir, module, key)
        else:
            idx = int(head)
        out[name] = load_state_file(ckpt_dir / layer_file(module, idx))[rest]
    return out

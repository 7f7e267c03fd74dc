"""Checkpoints of models with MoE layers: at stage 0, and at ZeRO stages 1 and 2 where their
experts are spread over ranks ([Note: ZeRO with spread experts]).

[Note: expert checkpoint files]
A rank holds experts num_local x ep_rank .. num_local x (ep_rank + 1) - 1 of each MoE layer
under local names (`...deepspeed_experts.<j>...`); a checkpoint names every expert by its
global index, so it loads at another ep_size (or into a model with every expert local, or
from one). Where experts are spread, the first copy of each (expert-data rank 0) writes,
per expert, upstream's `layer_<L>_expert_<g>_mp_rank_XX_model_states.pt` (its state dict,
global names; L counts the model's MoE layers in module order) and, beside it,
`layer_<L>_expert_<g>_mp_rank_XX_optim_states.pt` (its params' optimizer state, group
options and fp32 masters by name: [Note: named optimizer state]; under ZeRO gathered from the
expert's copies first, which every copy joins); the model-states file then holds the dense
part only, and ZeRO's rank files the dense groups. The model-states file records `moe`: the
layers (path, num_experts), and at stage 0 the names of rank 0's optimizer params,
globalised, so the dense optimizer state is read by name (ZeRO's layouts name theirs).
Loading takes this rank's experts from their files (or from the module state of a checkpoint
whose experts were all local), at stages 0-2 whichever stage saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext import comm
from deepspeed_ext.moe.layer import MOELayer
from deepspeed_ext.utils.errors import CheckpointError
from deepspeed_ext.zero.named_state import NamedState, from_stage0, from_zero, is_per_element

from . import safe_load
from .layout import expert_file_names


def layers(module: torch.nn.Module) -> list[tuple[str, MOELayer]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, MOELayer)]


def applies(engine: Any) -> bool:
    """Whether this engine's checkpoints take the expert layout (no pipeline; stage 0, or
    experts spread over ranks under ZeRO 1/2: a ZeRO model with ep_size 1 saves as any)."""
    return loads(engine) and (not engine.zero_optimization_stage() or spread(engine))


def loads(engine: Any) -> bool:
    """Whether this engine loads a checkpoint of the expert layout (stages 0-2, no pipeline)."""
    return bool(
        layers(engine.module)
        and engine.zero_optimization_stage() <= 2
        and not engine.pipeline_parallelism
    )


def spread(engine: Any) -> bool:
    """Experts on several ranks: the engine's spread layers (runtime/moe_setup.py)."""
    return bool(engine.moe_layers)


def _experts_root(path: str) -> str:
    """Where a layer's experts' state names start (each then its index and a dot)."""
    return f"{path}.experts.deepspeed_experts." if path else "experts.deepspeed_experts."


def _expert_roots(module: torch.nn.Module) -> tuple[str, ...]:
    return tuple(_experts_root(p) for p, _ in layers(module))


@dataclass(frozen=True)
class LocalExpert:
    layer_index: int  # among the model's MoE layers, in module order (the file names' L)
    layer: MOELayer
    index: int  # global expert index (the file names' g)
    local: str  # its state names' prefix on this rank
    glob: str  # ... in a checkpoint: the global index in place of the local one
    module: torch.nn.Module


def local_experts(module: torch.nn.Module) -> list[LocalExpert]:
    """This rank's experts, each with its global index and both name prefixes."""
    out = []
    for li, (path, m) in enumerate(layers(module)):
        ep_rank = m.ep_group.expert.rank if m.ep_group is not None else 0
        root = _experts_root(path)
        for j, expert in enumerate(m.experts.deepspeed_experts):
            g = ep_rank * m.num_local_experts + j
            out.append(LocalExpert(li, m, g, f"{root}{j}.", f"{root}{g}.", expert))
    return out


def global_names(module: torch.nn.Module) -> dict[str, str]:
    """This rank's local expert state names -> their global names."""
    out = {}
    for x in local_experts(module):
        for k in x.module.state_dict(keep_vars=True):
            out[x.local + k] = x.glob + k
    return out


# -- save ---------------------------------------------------------------------------------------
def model_state_part(engine: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The model-states file's dict with `moe` recorded and, where experts are spread, their
    entries (kept in their own files) taken out."""
    names = global_names(engine.module)
    zero = bool(engine.zero_optimization_stage())  # the dense state: in ZeRO's rank files
    info = {
        "layers": [(p, m.num_experts) for p, m in layers(engine.module)],
        "param_names": None
        if zero
        else [[names.get(n, n) for n in g] for g in engine.strategy.param_names()],
        "expert_files": spread(engine),
        "zero": zero,
    }
    out = {**state, "moe": info}
    if info["expert_files"]:
        out["module"] = {k: v for k, v in state["module"].items() if k not in names}
        if state.get("master_weights") is not None:
            masters = state["master_weights"]
            out["master_weights"] = {k: v for k, v in masters.items() if k not in names}
    return out


def write_expert_files(engine: Any, tmp: Path, mp_rank: int) -> None:
    """Every rank calls it (under ZeRO each expert's copies gather its partitioned state);
    the first copy of each expert writes its two files."""
    if not spread(engine):
        return
    strategy = engine.strategy
    optimizer = engine.optimizer
    options = _options_by_tensor(optimizer)
    for x in local_experts(engine.module):
        m, glob, expert = x.layer, x.glob, x.module
        writes = m.ep_group is None or m.ep_group.expert_data.rank == 0
        # frozen params stay in the model file (a resume needs them whatever
        # exclude_frozen_parameters says) and are listed, so zero_to_fp32 can leave them out
        opt_state: dict[str, Any] = {"state": {}, "options": {}, "master_weights": {}}
        frozen = [glob + k for k, p in expert.named_parameters() if not p.requires_grad]
        opt_state["frozen"] = frozen
        gathered: dict[int, torch.Tensor] = {}  # each bucket chunk gathered once per expert
        for k, p in expert.named_parameters():
            # [Note: param fragments]: whole at stage 0, gathered from the copies under ZeRO
            found = strategy.fragment_owner(p, "param")
            if found is None:  # frozen
                continue
            frag, master = found
            name = glob + k
            opt_state["master_weights"][name] = _whole(frag, master, master, gathered).float()
            if optimizer is not None:
                held = optimizer.state.get(master, {})
                opt_state["state"][name] = {
                    s: _whole(frag, master, v, gathered, s) for s, v in held.items()
                }
                opt_state["options"][name] = options.get(id(master), {})
        if writes:
            weights = {glob + k: v.detach().clone() for k, v in expert.state_dict().items()}
            model_file, optim_file = expert_file_names(x.layer_index, x.index, mp_rank)
            torch.save(weights, tmp / model_file)
            torch.save(opt_state, tmp / optim_file)


def _whole(
    frag: Any, master: torch.Tensor, value: Any, gathered: dict[int, torch.Tensor], key: str = ""
) -> Any:
    """A param's master or optimizer state value: a per-element one whole (under ZeRO its
    owner chunks gathered over the copies, once per chunk), any other (`step`) as held."""
    if key and not is_per_element(key, value, master.numel()):
        return value.detach().clone() if torch.is_tensor(value) else value
    if frag.chunk == 0:
        return frag.full(value)
    if id(value) not in gathered:
        gathered[id(value)] = frag.gather(value)
    return frag.full(value, gathered[id(value)])


def _options_by_tensor(optimizer: Any) -> dict[int, dict[str, Any]]:
    if optimizer is None:
        return {}
    out = {}
    for group in optimizer.param_groups:
        opts = {k: v for k, v in group.items() if k != "params"}
        for t in group["params"]:
            out[id(t)] = opts
    return out


def whole_state_dict(engine: Any, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """The module's state dict with every expert of every layer, globally named: experts
    spread over ranks are gathered over the expert-parallel group holding global rank 0 (the
    only one whose answer is kept; its ranks call it, the others skip it)."""
    roots = _expert_roots(engine.module)
    out = {k: v for k, v in engine.module.state_dict().items() if not k.startswith(roots)}
    for path, m in layers(engine.module):
        root = _experts_root(path)
        for j, expert in enumerate(m.experts.deepspeed_experts):
            params = dict(expert.named_parameters())
            for k, v in expert.state_dict().items():
                if m.ep_group is None:
                    out[f"{root}{j}.{k}"] = v
                    continue
                axis = m.ep_group.expert
                if 0 not in axis.ranks:  # only rank 0 keeps the answer: other groups skip it
                    continue
                parts = [torch.empty_like(v) for _ in range(axis.size)]
                comm.all_gather(parts, v.contiguous(), group=axis)
                # each rank's copy of this expert may be frozen or not: ask them all
                p = params.get(k)
                dev = comm.collective_device(axis)
                mine = torch.tensor([float(p is not None and p.requires_grad)], device=dev)
                flags = [torch.empty_like(mine) for _ in range(axis.size)]
                comm.all_gather(flags, mine, group=axis)
                for r, part in enumerate(parts):
                    if exclude_frozen and p is not None and not bool(flags[r].item()):
                        continue
                    out[f"{root}{r * m.num_local_experts + j}.{k}"] = part
    return out


# -- load ---------------------------------------------------------------------------------------
def localize_module(engine: Any, ckpt_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The model-states dict with this rank's experts under their local names (and no
    other expert)."""
    info = _check(engine, ckpt_dir, state)
    if info is None:
        return state
    roots = _expert_roots(engine.module)

    def dense(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if not k.startswith(roots)}

    saved_masters = state.get("master_weights")
    module = dense(state["module"])
    masters = dense(saved_masters) if saved_masters else None
    mp_rank = engine.layout.model.rank
    for x in local_experts(engine.module):
        local, glob = x.local, x.glob
        if info["expert_files"]:
            model_file, optim_file = expert_file_names(x.layer_index, x.index, mp_rank)
            weights = _read(ckpt_dir / model_file)
            held = _read(ckpt_dir / optim_file)["master_weights"] if masters is not None else {}
        else:  # every expert was local when saved: global names in the module state
            weights, held = state["module"], saved_masters or {}
        for k in x.module.state_dict(keep_vars=True):
            if glob + k in weights:
                module[local + k] = weights[glob + k]
            if masters is not None and glob + k in held:
                masters[local + k] = held[glob + k]
    return {**state, "module": module, "master_weights": masters}


def load_optimizer(engine: Any, files: Any, state: dict[str, Any]) -> None:
    """This rank's optimizer state by name ([Note: named optimizer state]): the dense params'
    from the model-states file, the experts' from their files; then what each rank keeps of
    its own (1-bit Adam's error buffers)."""
    ckpt_dir = files.where
    info = state["moe"]
    if not info.get("zero") and state.get("optimizer") is None:
        raise CheckpointError(
            f"{ckpt_dir} holds no optimizer state (saved without one): load it with "
            "load_optimizer_states=False"
        )
    names = global_names(engine.module)
    if info.get("zero"):  # the dense groups' partitions, in the rank files
        named = from_zero(files)
    else:
        # `state` holds this rank's experts under local names (localize_module): named
        # globally they are what the saved param names ask for (an fp32 model's masters are
        # its weights)
        weights = _globalised(state["module"], names)
        saved = {**state, "master_weights": _globalised(state.get("master_weights"), names)}
        named = from_stage0(saved, info["param_names"], weights, skip_missing=True)
    if info["expert_files"]:
        mp_rank = engine.layout.model.rank
        for x in local_experts(engine.module):
            held = _read(ckpt_dir / expert_file_names(x.layer_index, x.index, mp_rank)[1])
            for name, master in held["master_weights"].items():
                named.masters[name] = master.float().reshape(-1)
                named.options[name] = held["options"].get(name, {})
                named.state[name] = {
                    k: (v.reshape(-1) if is_per_element(k, v, master.numel()) else v)
                    for k, v in held["state"].get(name, {}).items()
                }
    local = NamedState()
    for n, _ in engine.module.named_parameters():
        g = names.get(n, n)
        if g in named.masters:
            local.masters[n] = named.masters[g]
            local.state[n] = named.state[g]
            local.options[n] = named.options[g]
    strategy = engine.strategy
    strategy.load_named_state(engine.optimizer, local, ckpt_dir)
    if engine.zero_optimization_stage():  # ZeRO keeps no per-rank state with MoE layers
        return  # (gradient_compression and 1-bit optimizers are refused with them)
    if hasattr(engine.optimizer, "load_per_rank_state_dict") or strategy.grads.exchange:
        strategy.load_per_rank(engine.optimizer, files)
        strategy.masters.copy_to_model()


def _globalised(d: Any, names: dict[str, str]) -> Any:
    """A state dict (or None) with this rank's expert names made global."""
    if not d:
        return d
    return {names.get(k, k): v for k, v in d.items()}


def _check(engine: Any, ckpt_dir: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    info = state.get("moe")
    if not loads(engine):
        if info is not None and info["expert_files"]:
            raise CheckpointError(
                f"{ckpt_dir} keeps its MoE experts in expert files (saved with experts spread "
                "over ranks): load it at zero_optimization.stage 0, 1 or 2 without pipeline "
                "parallelism"
            )
        return None
    if info is None:
        if spread(engine):
            raise CheckpointError(
                f"{ckpt_dir} was saved without the expert layout (ZeRO stage "
                f"{state.get('zero_stage')} or no MoE layer): load it into a model whose MoE "
                "layers have ep_size 1 at the stage it was saved with"
            )
        return None
    mine = [(p, m.num_experts) for p, m in layers(engine.module)]
    theirs = [tuple(x) for x in info["layers"]]
    if mine != theirs:
        raise CheckpointError(
            f"{ckpt_dir} holds MoE layers {theirs} (path, num_experts) but the model has "
            f"{mine}: build the model as it was saved (ep_size may differ)"
        )
    return info


def _read(path: Path) -> Any:
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing: the checkpoint's expert files are incomplete (copy the whole "
            "tag directory)"
        )
    return safe_load.load(path)

"""Rules that tie sections together (one key's meaning depends on another's). A key still
"auto" is skipped: its value is not known yet."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import support
from .sections.comms_logger import PROF_OPS
from .sections.scheduler import SCHEDULE_PARAMS, STEP_COUNT_PARAMS, step_count_problem
from .sections.sparse_attention import MODE_KEYS

if TYPE_CHECKING:
    from .model import DeepSpeedConfig

Check = Callable[["DeepSpeedConfig", set[str]], list[str]]


def _precision(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    out = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        out.append("fp16.enabled and bf16.enabled are both true; enable one of them")
    autocast = cfg.torch_autocast
    for key in ("fp16", "bf16"):
        if autocast.enabled and getattr(cfg, key).enabled:
            out.append(
                f"torch_autocast.enabled and {key}.enabled are both true: torch_autocast keeps "
                f"the model in fp32 and runs its forward under torch.autocast, {key} casts the "
                "model; enable one of them"
            )
    types = cfg.data_types  # [Note: module cast]
    model = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    decided = not {"fp16.enabled", "bf16.enabled"} & autos  # "auto": the HF Trainer fills it
    if decided and types.param_dtype is not None and types.param_dtype != model:
        out.append(
            f'data_types.param_dtype "{types.param_dtype}" conflicts with the model\'s dtype, '
            f'"{model}" (from fp16 / bf16): enable the matching section, or remove '
            "data_types.param_dtype"
        )
    if decided and types.buffer_dtype is not None and model == "fp32":
        out.append(
            "data_types.buffer_dtype casts the buffers of an fp16 or bf16 model, and neither "
            "is enabled: enable one, or remove data_types.buffer_dtype"
        )
    if cfg.fp16.auto_cast and not cfg.fp16.enabled:
        out.append(
            "fp16.auto_cast casts the forward's floating-point inputs to fp16 for an fp16 model, "
            "but fp16.enabled is false: enable fp16, or remove fp16.auto_cast"
        )
    if autocast.enabled and autocast.dtype == "fp32":
        out.append(
            'torch_autocast.dtype "fp32": autocast runs ops in a lower precision; set "bf16" '
            'or "fp16", or disable torch_autocast'
        )
    if cfg.amp is not None and cfg.amp.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        out.append("amp.enabled cannot be combined with fp16.enabled or bf16.enabled")
    if cfg.fp16_override_modules and not (cfg.fp16.enabled or cfg.bf16.enabled):
        out.append(
            "fp16_override_modules keeps modules in fp32 inside a 16-bit model: enable "
            "fp16 or bf16, or remove it"
        )
    fp16 = cfg.fp16
    if fp16.enabled and fp16.dynamic_loss_scale:  # only dynamic scaling uses these two
        for key in ("loss_scale_window", "min_loss_scale"):
            if getattr(fp16, key) <= 0 and f"fp16.{key}" not in autos:
                out.append(f"fp16.{key} must be > 0 with dynamic loss scaling (loss_scale 0)")
    return out


def _offload(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    zero, out = cfg.zero_optimization, []
    for name in ("offload_param", "offload_optimizer"):
        section = getattr(zero, name)
        if section is not None and section.device == "nvme" and not section.nvme_path:
            out.append(f'zero_optimization.{name}.nvme_path is required with device "nvme"')
    opt = zero.offload_optimizer
    staged = "zero_optimization.stage" not in autos
    if opt is not None and opt.device == "nvme" and staged and zero.stage != 3:
        out.append(
            'zero_optimization.offload_optimizer.device "nvme" needs zero_optimization.stage 3 '
            '(ZeRO-Infinity); use device "cpu" with stages 1 and 2'
        )
    if opt is not None and opt.ratio < 1.0 and zero.stage != 3:
        out.append("zero_optimization.offload_optimizer.ratio < 1 (partial offload) needs stage 3")
    if opt is not None and opt.step_in_backward:
        out += _step_in_backward(cfg, opt.device, autos)
    if opt is not None and opt.step_in_forward:
        out += _step_in_forward(opt.device, opt.step_in_backward)
    return out


def _step_in_forward(device: str, in_backward: bool) -> list[str]:
    """[Note: optimizer steps in forward]"""
    key = "zero_optimization.offload_optimizer.step_in_forward"
    out = []
    if device != "nvme":
        out.append(
            f"{key} overlaps NVMe reads and writes with the next forward, but "
            f'offload_optimizer.device is "{device}": set it to "nvme", or remove {key}'
        )
    if in_backward:
        out.append(
            f"{key} and offload_optimizer.step_in_backward both move the optimizer step out "
            "of engine.step(): keep one (step_in_backward needs no gradient clipping)"
        )
    return out


def _step_in_backward(cfg: DeepSpeedConfig, device: str, autos: set[str]) -> list[str]:
    """[Note: optimizer steps in backward]: updates made before engine.step() must be the
    ones it would make."""
    key = "zero_optimization.offload_optimizer.step_in_backward"
    clip = "gradient_clipping" not in autos and bool(cfg.gradient_clipping)
    bf16_check = cfg.bf16.enabled and cfg.bf16.check_grad_overflow
    clashes = {  # what clashes: why, and the fix
        f'offload_optimizer.device "{device}"': (
            device != "nvme",
            'it overlaps NVMe reads and writes; set offload_optimizer.device "nvme"',
        ),
        f"gradient_clipping {cfg.gradient_clipping}": (
            clip,
            "clipping needs the global norm before any update; set gradient_clipping 0 "
            "(its default is 1.0)",
        ),
        "fp16.enabled": (cfg.fp16.enabled, "a step may be skipped on overflow; use bf16"),
        "bf16.check_grad_overflow": (bf16_check, "a step may be skipped; set it false"),
    }
    return [
        f"{key} does not work with {k}: {fix}, or remove {key}"
        for k, (on, fix) in clashes.items()
        if on
    ]


def _zero_stage(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    zero, out = cfg.zero_optimization, []
    if not zero.compute_grad_norm and zero.stage not in (1, 2):
        out.append("zero_optimization.compute_grad_norm false is supported with stage 1 or 2 only")
    if cfg.gradient_allreduce_op == "sum":
        clashes = {
            "zero_optimization.stage 3": zero.stage == 3,
            "zero_optimization.zenflow": zero.zenflow is not None,
            "compile.deepcompile": cfg.compile.deepcompile,
        }
        out += [
            f'gradient_allreduce_op "sum" does not work with {k}' for k, on in clashes.items() if on
        ]
    needs_zero = {
        "fp16.fp16_master_weights_and_grads": cfg.fp16.fp16_master_weights_and_grads,
        "bf16.bf16_master_weights_and_grads": cfg.bf16.bf16_master_weights_and_grads,
        "bf16.bf16_optimizer_states": cfg.bf16.bf16_optimizer_states,
    }
    for key, on in needs_zero.items():
        if on and zero.stage == 0:
            out.append(f"{key} needs zero_optimization.stage 1, 2 or 3")
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        out.append("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads")
    return out


def _tensor_parallel(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    tp, out = cfg.tensor_parallel.autotp_size, []
    if tp < 0:
        out.append(f"tensor_parallel.autotp_size must be >= 0 (0 or 1: no slicing), got {tp}")
    zero = cfg.zero_optimization
    split = tp > 1 or (cfg.pipeline_parallelism.num_stages or 0) > 1
    offload = zero.offload_param is not None and zero.offload_param.device != "none"
    if split and zero.stage == 3 and offload and "zero_optimization.stage" not in autos:
        # stage 3 runs as stage 2 there ([Note: stage 3 under model parallelism])
        out.append(
            "zero_optimization.offload_param needs zero_optimization.stage 3, which runs as "
            "stage 2 with pipeline stages or tensor slicing: remove it, or drop the model "
            "parallelism"
        )
    return out


def _sparse_attention(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """[Note: sparse attention from the config]: every key set must shape the layout."""
    sa = cfg.sparse_attention
    if sa is None:
        return []
    out = [
        f"sparse_attention.{key}: mode '{sa.mode}' does not use it (its keys: "
        f"{', '.join(MODE_KEYS[sa.mode])}); remove it, or pick the mode it belongs to"
        for key in sa.unused_keys()
    ]
    if cfg.tensor_parallel.autotp_size > 1:
        out.append(
            "sparse_attention with tensor_parallel.autotp_size > 1: the layout covers every "
            "head, and tensor slicing splits the heads across ranks; remove one of them"
        )
    return out


def _refused(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    return support.refused(cfg)  # [Note: config honesty]


_ONEBIT = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}


def _onebit(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """1-bit optimizers exchange compressed momentum instead of gradients."""
    opt = cfg.optimizer
    if opt is None or not opt.type or str(opt.type).lower() not in _ONEBIT:
        return []
    stage = cfg.zero_optimization.stage
    if "zero_optimization.stage" not in autos and stage != 0:
        return [
            f"optimizer.type '{opt.type}' runs with zero_optimization.stage 0 only (as "
            f"upstream): it exchanges compressed momentum where ZeRO reduces gradients into "
            f"partitions; set the stage to 0 (it is {stage})"
        ]
    if cfg.gradient_allreduce_op == "sum":
        # the warm-up would sum, the exchange after the freeze averages the momentum, and the
        # frozen variance keeps the sum's scale: updates would shrink towards 1/N
        return [
            f"gradient_allreduce_op \"sum\" does not apply to optimizer.type '{opt.type}': "
            "after the freeze it exchanges the mean of the momentum; remove it"
        ]
    return []


# torch.optim classes whose update is not elementwise: stepping ZeRO's flat partitions is
# not stepping the params (factored or per-tensor second moments, orthogonalised matrices,
# line searches); LAMB's trust ratio needs each tensor whole
_WHOLE_TENSOR = {
    "adafactor": "factors the second moment of each weight matrix",
    "muon": "orthogonalises each weight matrix",
    "lbfgs": "searches along the whole parameter vector",
    "sparseadam": "takes sparse gradients, which ZeRO does not make",
    "lamb": "scales each tensor's update by a trust ratio of its whole norms",
}


# optimizer params every optimizer takes as numbers: a quoted one ("1e-3", as YAML or an
# environment variable leaves it) failed deep in the constructor, naming neither
_NUMERIC_PARAMS = {"lr", "eps", "weight_decay", "momentum", "dampening", "max_coeff", "min_coeff"}


def _optimizer(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """An optimizer section must name its type; one ZeRO cannot partition is refused before
    any rank starts (a client optimizer object is checked at initialize)."""
    opt = cfg.optimizer
    if opt is None:
        return []
    if not opt.type:
        if opt.params:
            return [
                "optimizer.params are given without optimizer.type: no optimizer would be "
                'built from them; name one ("type": "AdamW", ...) or remove the section'
            ]
        return []
    out = [
        f"optimizer.params.{k} is the string {v!r}: give a number ({v} without quotes)"
        for k, v in opt.params.items()
        if k in _NUMERIC_PARAMS and isinstance(v, str) and v != "auto"
    ]
    betas = opt.params.get("betas")
    if isinstance(betas, (list, tuple)) and any(isinstance(b, str) for b in betas):
        out.append(f"optimizer.params.betas is {betas!r}: give two numbers, without quotes")
    if str(opt.type).lower() == "adamw" and opt.params.get("adam_w_mode") is False:
        out.append(
            'optimizer.params.adam_w_mode is false but optimizer.type "AdamW" decouples weight '
            'decay whatever it says: for L2-style decay use "type": "Adam" with adam_w_mode '
            "false, or remove adam_w_mode"
        )
    if out:
        return out
    why = _WHOLE_TENSOR.get(str(opt.type).lower())
    stage = cfg.zero_optimization.stage
    if why and stage != 0 and "zero_optimization.stage" not in autos:
        return [
            f"optimizer.type '{opt.type}' {why}, which ZeRO's flat partitions cannot give it "
            f"(zero_optimization.stage is {stage}): use stage 0, or an elementwise optimizer "
            "such as AdamW"
        ]
    return []


def _scheduler(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """DeepSpeed's own schedules: a miscased type, an unknown or missing param, a number in
    quotes. Other types (torch.optim.lr_scheduler's) are checked at initialize, which has
    torch to look them up."""
    sch = cfg.scheduler
    if sch is None or not sch.type:
        return []
    name = str(sch.type)
    by_lower = {k.lower(): k for k in SCHEDULE_PARAMS}
    if name not in SCHEDULE_PARAMS:
        right = by_lower.get(name.lower())
        return [f"scheduler.type {name!r}: did you mean {right!r}?"] if right else []
    required, optional = SCHEDULE_PARAMS[name]
    accepted = required + optional
    out = []
    for key, value in sch.params.items():
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"{name} takes {', '.join(accepted)}"
            out.append(f"scheduler.params.{key} is not a {name} param: {hint}")
        elif isinstance(value, str) and key != "warmup_type":  # (parse took the autos out)
            out.append(f"scheduler.params.{key} is the string {value!r}: give a number")
        elif key in STEP_COUNT_PARAMS.get(name, ()):
            problem = step_count_problem(key, value)
            if problem:
                out.append(f"scheduler.params.{problem}")
    missing = [k for k in required if k not in sch.params and f"scheduler.params.{k}" not in autos]
    if missing:
        out.append(f"scheduler {name} needs scheduler.params.{', '.join(missing)}")
    return out


def _comms_logger(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """A misspelt op in prof_ops was taken and never matched: nothing was logged."""
    out = []
    for op in cfg.comms_logger.prof_ops:
        if op not in PROF_OPS:
            close = difflib.get_close_matches(op, sorted(PROF_OPS), n=1, cutoff=0.7)
            hint = f"did you mean {close[0]!r}?" if close else "it names no collective"
            out.append(f"comms_logger.prof_ops: {op!r} is not a deepspeed.comm op: {hint}")
    return out


def _profiler_and_monitors(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """Values that were taken and then meant nothing: a profile step never reached, a
    table of no modules, a job folder with no name (the default name was used instead)."""
    out = []
    fp = cfg.flops_profiler
    if fp.enabled and fp.profile_step < 0:
        out.append(
            f"flops_profiler.profile_step is {fp.profile_step}: no step has that number; "
            "give the optimizer steps to complete before the profiled one (0: the first)"
        )
    if fp.enabled and fp.top_modules < 1:
        out.append(f"flops_profiler.top_modules is {fp.top_modules}: give 1 or more")
    if fp.enabled and fp.module_depth < -1:
        out.append(
            f"flops_profiler.module_depth is {fp.module_depth}: give -1 (every depth) or "
            "a depth of 0 or more"
        )
    for section in ("jsonl_monitor", "csv_monitor", "tensorboard"):
        mon = getattr(cfg, section)
        if mon.enabled and not str(mon.job_name).strip():
            out.append(f"{section}.job_name is empty: name the run's folder under output_path")
    return out


def _gradient_compression(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """Compressed gradients replace the data-parallel all-reduce (stage 0) or reduce-scatter
    (ZeRO 1/2) of the mean."""
    gc = cfg.gradient_compression
    if gc is None:
        return []
    out = []
    stage = cfg.zero_optimization.stage
    if "zero_optimization.stage" not in autos and stage == 3:
        out.append(
            "gradient_compression runs with zero_optimization.stage 0, 1 or 2: stage 3 "
            "reduce-scatters each module's gradients as backward reaches it, one collective per "
            "module, where error feedback would need a full-size buffer per module; set the "
            "stage to 2 or remove gradient_compression"
        )
    if gc.algorithm != "topk":
        defaults = type(gc).model_fields
        for key in ("topk_ratio", "huffman_coding"):
            if getattr(gc, key) != defaults[key].default:  # the effective config repeats them
                out.append(
                    f"gradient_compression.{key} applies to algorithm 'topk' (the (index, value) "
                    f"pairs), not '{gc.algorithm}'; set algorithm to 'topk' or remove {key}"
                )
    if cfg.communication_data_type not in (None, cfg.data_types.grad_accum_dtype or "fp32"):
        out.append(
            "gradient_compression sends its own codes (signs, scales, indices), not gradients "
            f"in a dtype: communication_data_type {cfg.communication_data_type!r} does not "
            "apply; remove it"
        )
    if (
        cfg.gradient_allreduce_op == "sum"
        or cfg.prescale_gradients
        or cfg.gradient_predivide_factor != 1.0
    ):
        out.append(
            "gradient_compression exchanges the mean of the gradients, decoded in fp32: "
            'gradient_allreduce_op "sum", prescale_gradients and gradient_predivide_factor do '
            "not apply; remove them"
        )
    if cfg.fp16.enabled:
        out.append(
            "gradient_compression with fp16: the loss scaler skips a step whose gradients "
            "overflowed only after the exchange has folded them into every rank's error "
            "buffers; train in bf16 or fp32, or remove gradient_compression"
        )
    opt = cfg.optimizer
    if opt is not None and opt.type and str(opt.type).lower() in _ONEBIT:
        out.append(
            f"gradient_compression and optimizer.type '{opt.type}' both compress: the 1-bit "
            "optimizer already exchanges compressed momentum; remove gradient_compression"
        )
    return out


def _slow_nodes(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    c = cfg.communication
    if c.slow_node_tolerance is None and c.slow_node_interval is not None:
        return [
            "communication.slow_node_interval applies with communication.slow_node_tolerance; "
            "set the tolerance (e.g. 0.25) or remove the interval"
        ]
    return []


def _communication(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """The hierarchical all-reduce replaces the stage-0 gradient buckets' all-reduce."""
    if cfg.communication.topology != "hierarchical":
        if cfg.communication.ranks_per_node is not None:
            return [
                "communication.ranks_per_node applies with communication.topology "
                "'hierarchical'; set the topology or remove ranks_per_node"
            ]
        return []
    if not cfg.zero_optimization.reduce_scatter:
        return [
            "communication.topology 'hierarchical' runs ZeRO's reduce-scatter in two steps "
            "(and stage 0's all-reduce in three); zero_optimization.reduce_scatter false asks "
            "for a flat all-reduce instead: keep one"
        ]
    if cfg.gradient_compression is not None:
        return [
            "communication.topology 'hierarchical' and gradient_compression both replace the "
            "gradient all-reduce; keep one"
        ]
    return []


# monitor section -> (module it imports, what pip installs)
_MONITOR_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet-ml"),
}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _monitor_packages(cfg: DeepSpeedConfig, autos: set[str]) -> list[str]:
    """A monitor whose package is missing is found here, before any rank starts, not when
    rank 0 first writes a metric."""
    return [
        f"{section}.enabled: the {module} package is not installed; pip install {pip}, or "
        f"set {section}.enabled to false"
        for section, (module, pip) in _MONITOR_PACKAGES.items()
        if getattr(cfg, section).enabled and not _installed(module)
    ]


CHECKS: tuple[Check, ...] = (
    _refused,
    _precision,
    _offload,
    _zero_stage,
    _tensor_parallel,
    _monitor_packages,
    _onebit,
    _optimizer,
    _scheduler,
    _comms_logger,
    _profiler_and_monitors,
    _gradient_compression,
    _communication,
    _slow_nodes,
    _sparse_attention,
)


def consistency(cfg: DeepSpeedConfig) -> list[str]:
    autos = set(cfg.unresolved_autos())
    return [problem for check in CHECKS for problem in check(cfg, autos)]

"""What the runtime does with each config key it accepts but does not run.

[Note: config honesty]
Every field of the typed config is one of:
- honoured: the runtime reads it (tests/unit/config/test_config_honesty.py records which
  fields the runtime reads while it trains, saves and loads, and fails on a field that is
  neither read nor listed here);
- REFUSED: setting it (a value other than the default, or turning the section on) is a config
  error that names the key, found when the config is parsed, so before any rank starts;
- NOTED: it can only change speed or logging, never what training computes; a value other
  than the default is reported once as having no effect here;
- INERT: upstream's own behaviour makes it a no-op here (a guard this runtime never needs);
  accepted quietly, listed in the README.
A section path covers every key inside it. A section is "set" when it is turned on (its
`active()`); a key when its value differs from the default, or is not among `allowed`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from .types import Section

if TYPE_CHECKING:
    from .model import DeepSpeedConfig


@dataclass(frozen=True)
class Rule:
    why: str
    allowed: tuple[Any, ...] | None = None  # values that are fine besides the default
    # refused only when this also holds (for keys whose meaning depends on another key)
    when: Callable[[Any], bool] | None = None


_ZEROPP = "ZeRO++ (quantized weights/gradients, hierarchical partitions) is not built yet"
_MICS = "MiCS (sharding within sub-groups) was removed upstream in 0.19; remove it"
# upstream 0.19 refuses these as removed features (not waiting to be built here): say so
_GONE = "was removed upstream in 0.19 (its config refuses it too); remove it"
_SP = "Ulysses sequence parallelism is not built yet"
_OBS = "(not built yet)"
_UNBUILT = "(not built yet)"

REFUSED: dict[str, Rule] = {
    # whole sections (refused when turned on)
    "amp": Rule(f"NVIDIA apex AMP {_GONE}, and use fp16, bf16 or torch_autocast"),
    "autotuning": Rule(f"the autotuner {_UNBUILT}"),
    "compile": Rule(f"DeepCompile {_UNBUILT}"),
    "compression_training": Rule(f"the compression library {_GONE}"),
    "curriculum_learning": Rule(
        f"the legacy top-level curriculum_learning {_GONE} (upstream's successor, "
        "data_efficiency.data_sampling.curriculum_learning, is not built yet)"
    ),
    "data_efficiency": Rule(f"data efficiency (curriculum, random-LTD) {_UNBUILT}"),
    "eigenvalue": Rule(f"eigenvalue-based mixture of quantization {_GONE}"),
    "elasticity": Rule(
        f"elastic training {_GONE}; set train_batch_size / train_micro_batch_size_per_gpu / "
        "gradient_accumulation_steps directly"
    ),
    "expert_parallel": Rule(
        "AutoEP (experts injected into an unmodified model's MoE blocks) is not built yet; "
        "build the model's MoE layers with deepspeed.moe.layer.MoE(..., ep_size=N) instead"
    ),
    "hybrid_engine": Rule(f"the hybrid (RLHF) engine {_UNBUILT}"),
    "nebula": Rule(f"Nebula checkpointing {_GONE}"),
    "progressive_layer_drop": Rule(f"progressive layer drop {_GONE}"),
    "quantize_training": Rule(f"mixture of quantization (quantize_training) {_GONE}"),
    "tensor_parallel.vocab_parallel_lm_head": Rule(
        f"a vocabulary-parallel lm_head {_UNBUILT}; lm_head stays whole", allowed=(False,)
    ),
    "tensor_parallel.vocab_parallel_ce_backend": Rule(
        f"the liger cross-entropy backend {_UNBUILT}"
    ),
    "tensor_parallel.keep_module_on_host": Rule(f"keeping sliced modules on the host {_UNBUILT}"),
    "tensor_parallel.replace_with_kernel_inject": Rule(
        "inference kernel injection does not apply to training; remove it"
    ),
    "tensor_parallel.tp.tp_size": Rule(
        "it is the inference engine's tensor-parallel size; for training set "
        "tensor_parallel.autotp_size",
        when=lambda cfg: cfg.tensor_parallel.tp.tp_size != cfg.tensor_parallel.autotp_size,
    ),
    "tensor_parallel.tp.tp_grain_size": Rule(f"uneven (grain-sized) slices {_UNBUILT}"),
    "tensor_parallel.dtype": Rule(
        "the model's dtype comes from the fp16 / bf16 sections; set it alike or remove it",
        when=lambda cfg: (
            cfg.tensor_parallel.dtype
            != ("fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32")
        ),
    ),
    "torch_autocast.lower_precision_safe_modules": Rule(
        "it picks the modules whose gradients upstream reduces in the autocast dtype; here "
        "every gradient is reduced in communication_data_type (fp32 unless set): remove it, "
        "and set communication_data_type to reduce in 16 bits ([Note: torch_autocast])"
    ),
    "weight_quantization": Rule(f"weight quantization {_UNBUILT}"),
    "zero_optimization.zenflow": Rule(f"ZenFlow {_UNBUILT}"),
    "datastates_ckpt": Rule(
        f"DataStates checkpointing {_UNBUILT}", allowed=(False, {}, {"enabled": False})
    ),
    # single keys
    "sparse_gradients": Rule(
        f"sparse compression of dense embedding gradients {_GONE} (an nn.Embedding with "
        "sparse=True is not built yet either)"
    ),
    "graph_harvesting": Rule(f"CUDA-graph harvesting {_GONE}"),
    "sequence_parallel_size": Rule(_SP, allowed=(1,)),
    "disable_allgather": Rule(f"replacing the all-gather by broadcasts {_UNBUILT}"),
    "fp16.fp16_master_weights_and_grads": Rule(f"fp16 master weights {_UNBUILT}"),
    "bf16.bf16_master_weights_and_grads": Rule(f"bf16 master weights {_UNBUILT}"),
    "bf16.bf16_optimizer_states": Rule(f"bf16 optimizer states {_UNBUILT}"),
    "checkpoint.load_universal": Rule(f"universal checkpoints {_UNBUILT}"),
    "checkpoint.use_node_local_storage": Rule(
        "node-local checkpoint storage is not built yet; save to a shared path"
    ),
    "checkpoint.writer.type": Rule(
        "the MOCK writer writes nothing, which would lose checkpoints silently",
        allowed=("PYTHON",),
    ),
    "zero_optimization.compute_grad_norm": Rule(f"skipping the gradient norm {_UNBUILT}"),
    "zero_optimization.legacy_stage1": Rule("legacy stage 1 was removed upstream; drop it"),
    "zero_optimization.zero_hpz_partition_size": Rule(_ZEROPP),
    "zero_optimization.zero_quantized_weights": Rule(_ZEROPP),
    "zero_optimization.zero_quantized_nontrainable_weights": Rule(_ZEROPP),
    "zero_optimization.zero_quantized_gradients": Rule(_ZEROPP),
    "zero_optimization.zeropp_loco_param": Rule(f"LoCo-ZeRO++ {_GONE}"),
    "zero_optimization.mics_shard_size": Rule(_MICS),
    "zero_optimization.mics_hierarchical_params_gather": Rule(_MICS),
    "zero_optimization.pipeline_loading_checkpoint": Rule(
        f"pipelined checkpoint loading {_UNBUILT}"
    ),
    "zero_optimization.enable_sanity_checks": Rule(f"ZeRO-3 sanity checks {_UNBUILT}"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": Rule(f"the Muon optimizer {_UNBUILT}"),
    "zero_optimization.offload_optimizer.ratio": Rule(f"partial optimizer offload {_UNBUILT}"),
    "zero_optimization.offload_optimizer.super_offload": Rule(f"SuperOffload {_UNBUILT}"),
    "aio.use_gds": Rule(f"GPUDirect Storage {_UNBUILT}"),
}

_SPEED = "it tunes speed only and this runtime does not use it"
NOTED: dict[str, Rule] = {
    "zero_optimization.contiguous_gradients": Rule("gradients always go into contiguous buckets"),
    "zero_optimization.use_multi_rank_bucket_allreduce": Rule(_SPEED),
    "zero_optimization.allgather_partitions": Rule(
        "stages 1-2 always all-gather updated partitions"
    ),
    "zero_optimization.round_robin_gradients": Rule(_SPEED),
    "tensor_parallel.tp_overlap_comm": Rule(
        "the sliced layers' all-reduces run in line with the compute"
    ),
    "zero_optimization.elastic_checkpoint": Rule("checkpoints always load at another world size"),
    "zero_optimization.parameter_alignment": Rule(_SPEED),
    "zero_optimization.memory_efficient_linear": Rule(_SPEED),
    "zero_optimization.log_trace_cache_warnings": Rule("no trace cache here to warn about"),
    "zero_optimization.stage3_module_granularity_threshold": Rule(_SPEED),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": Rule(_SPEED),
    "zero_optimization.stage3_allgather_sequential": Rule(_SPEED),
    "zero_optimization.offload_optimizer.buffer_count": Rule(_SPEED),
    "zero_optimization.offload_optimizer.pin_memory": Rule(
        "host buffers are pinned whenever a GPU is"
    ),
    "zero_optimization.offload_optimizer.fast_init": Rule(_SPEED),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Rule(_SPEED),
    "bf16.immediate_grad_update": Rule(_SPEED),
    "optimizer.legacy_fusion": Rule("upstream ignores it too"),
    "disable_python_gc": Rule(_SPEED),
    "checkpoint.checkpoint_serialization": Rule("checkpoints always use torch's zip format"),
    "checkpoint.writer": Rule(_SPEED),
    "flops_profiler.recompute_fwd_factor": Rule(
        "the backward is counted as it runs, recomputed forwards included"
    ),
}

INERT: dict[str, str] = {
    "seq_parallel_communication_data_type": "it applies with sequence_parallel_size > 1 only",
}

# Keys some guides use for features other issues build: not in the typed config yet, so
# unknown, but the error says what they are rather than suggesting a near spelling.
NOT_YET: dict[str, str] = {}

# Keys the config parser itself consumes.
PARSER_KEYS = frozenset({"strict"})


def leaf_fields(cls: type[BaseModel] = None, path: str = "") -> Iterator[tuple[str, type, str]]:  # type: ignore[assignment]
    """(dotted path, owning class, field name) of every leaf of the typed config."""
    if cls is None:
        from .model import DeepSpeedConfig

        cls = DeepSpeedConfig
    for name, field in cls.model_fields.items():
        here = f"{path}.{name}" if path else name
        section = _section_type(field.annotation)
        if section is None:
            yield here, cls, name
        else:
            yield from leaf_fields(section, here)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    from typing import get_args

    for a in get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def covered(path: str) -> str | None:
    """Which registry classifies this path (or an enclosing section), if any."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        here = ".".join(parts[:i])
        for name, table in (("REFUSED", REFUSED), ("NOTED", NOTED), ("INERT", INERT)):
            if here in table:
                return name
    return "PARSER_KEYS" if path in PARSER_KEYS else None


def _lookup(cfg: Any, path: str) -> tuple[Any, Any, bool]:
    """(owner, value, present) for a dotted path; absent when an optional section is None."""
    owner: Any = None
    value: Any = cfg
    for part in path.split("."):
        if value is None:
            return owner, None, False
        owner, value = value, getattr(value, part)
    return owner, value, True


def _is_set(cfg: Any, path: str, allowed: tuple[Any, ...] | None = None) -> bool:
    """Whether the user asked for something by this path: a section turned on, or a key
    given with a value other than its default and `allowed` (a default a validator fills
    in, as overlap_comm's per stage, is not asked for)."""
    owner, value, present = _lookup(cfg, path)
    if not present:
        return False
    if isinstance(value, Section):
        return value.active()
    if path.rsplit(".", 1)[-1] not in owner.model_fields_set:
        return False
    default = (
        type(owner).model_fields[path.rsplit(".", 1)[-1]].get_default(call_default_factory=True)
    )
    return value != default and not (allowed and value in allowed)


def refused(cfg: DeepSpeedConfig) -> list[str]:
    out = []
    for path, rule in REFUSED.items():
        if _is_set(cfg, path, rule.allowed) and (rule.when is None or rule.when(cfg)):
            section = isinstance(_lookup(cfg, path)[1], Section)
            fix = "remove the section or turn it off" if section else "remove it"
            says_fix = re.search(r"\bremove (it|the)\b", rule.why)  # a fix of its own
            tail = "" if says_fix else f"; {fix} (or set it to its default)"
            out.append(f"{path}: {rule.why}{tail}")
    return out


def pipeline_only_set(cfg: DeepSpeedConfig) -> list[str]:
    """The keys only a pipeline engine reads that the config sets to other than their
    defaults: an engine of a plain model says so once instead of dropping them unsaid."""
    pipe = cfg.pipeline
    out = [
        f"pipeline.{name}"
        for name, field in type(pipe).model_fields.items()
        if getattr(pipe, name) != field.get_default(call_default_factory=True)
    ]
    if cfg.checkpoint.parallel_write.pipeline_stage:
        out.append("checkpoint.parallel_write.pipeline_stage")
    return out


def keys_have(keys: list[str]) -> str:
    """'a has' / 'a, b have': the start of a line naming keys that do nothing."""
    return f"{', '.join(keys)} {'has' if len(keys) == 1 else 'have'}"


def stage_mismatched(cfg: DeepSpeedConfig) -> list[str]:
    """Keys only another ZeRO stage (or offload device) reads, set where they cannot act:
    one line per reason, said once at start like the NOTED keys (they move memory, never
    what training computes)."""
    z = cfg.zero_optimization
    stage, out = z.stage, []
    if stage < 3:
        names = [n for n in type(z).model_fields if n.startswith("stage3_")]
        keys = [f"zero_optimization.{n}" for n in [*names, "sub_group_size"]]
        keys = [k for k in keys if _is_set(cfg, k)]
        if z.offload_param is not None and z.offload_param.device != "none":
            keys.append("zero_optimization.offload_param")
        if keys:
            out.append(
                f"{keys_have(keys)} no effect at "
                f"zero_optimization.stage {stage}: only stage 3 (partitioned parameters) reads "
                f"{'it' if len(keys) == 1 else 'them'}"
            )
    off = z.offload_optimizer
    if stage == 0 and off is not None and off.device != "none":
        out.append(
            "zero_optimization.offload_optimizer has no effect at zero_optimization.stage 0: "
            "the optimizer runs beside the model; offload needs stage 1, 2 or 3"
        )
    if off is not None and off.device == "cpu":
        out += _unread(
            cfg,
            "zero_optimization.offload_optimizer",
            ("pipeline_read", "pipeline_write", "nvme_path"),
            'with offload_optimizer.device "cpu": they place and overlap NVMe reads and writes',
        )
    par = z.offload_param
    if stage == 3 and par is not None and par.device == "cpu":
        out += _unread(
            cfg,
            "zero_optimization.offload_param",
            ("max_in_cpu", "buffer_size", "buffer_count", "nvme_path"),
            'with offload_param.device "cpu": they size and place the NVMe swap',
        )
    nvme_opt = off is not None and off.device == "nvme"
    if stage == 3 and not nvme_opt and _is_set(cfg, "zero_optimization.sub_group_size"):
        out.append(
            "zero_optimization.sub_group_size has no effect without offload_optimizer.device "
            '"nvme": it is the number of elements swapped in per optimizer sub-step'
        )
    if stage == 0:
        out += _unread(
            cfg,
            "zero_optimization",
            ("overlap_comm", "reduce_scatter", "allgather_bucket_size"),
            "at zero_optimization.stage 0: they tune ZeRO's reduce-scatter and all-gather "
            "(stage 0 all-reduces gradient buckets while backward runs)",
        )
        out += _unread(
            cfg,
            "zero_optimization",
            ("load_from_fp32_weights",),
            "at zero_optimization.stage 0: a checkpoint's fp32 masters always load there (as "
            "upstream's)",
        )
    if stage in (0, 3):
        out += _unread(
            cfg,
            "zero_optimization",
            ("ignore_unused_parameters",),
            f"at zero_optimization.stage {stage}: it is read at stages 1 and 2 (upstream's at "
            "stage 2)",
        )
    return out + _unread_elsewhere(cfg)


def _unread(cfg: DeepSpeedConfig, section: str, names: tuple[str, ...], why: str) -> list[str]:
    """One line naming the keys of `section` the config sets, which have no effect `why`."""
    keys = [f"{section}.{k}" for k in names if _is_set(cfg, f"{section}.{k}")]
    return [f"{keys_have(keys)} no effect {why}"] if keys else []


def _unread_elsewhere(cfg: DeepSpeedConfig) -> list[str]:
    """Keys outside zero_optimization that another setting makes unread."""
    out = []
    z = cfg.zero_optimization
    uses_nvme = any(
        s is not None and s.device == "nvme" for s in (z.offload_param, z.offload_optimizer)
    )
    if not uses_nvme:
        aio = tuple(type(cfg.aio).model_fields)
        out += _unread(cfg, "aio", aio, "without an NVMe offload: aio drives NVMe I/O")
    fp16 = cfg.fp16
    if fp16.enabled and not fp16.dynamic_loss_scale:
        names = (
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        )
        out += _unread(
            cfg,
            "fp16",
            names,
            f"with a static fp16.loss_scale ({fp16.loss_scale:g}): they drive dynamic loss "
            "scaling (loss_scale 0)",
        )
    if not (fp16.enabled or cfg.bf16.enabled):
        out += _unread(
            cfg,
            "data_types",
            ("keep_in_fp32_modules",),
            "in the engine without fp16 or bf16: it casts nothing to 16 bits (a zero.Init "
            "given a dtype reads it; [Note: module cast])",
        )
    if not fp16.enabled:  # with fp16 off, fp16's own loss-scale keys drive nothing
        out += _unread(
            cfg,
            "fp16",
            ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"),
            "with fp16.enabled false (torch_autocast in fp16 scales the loss as torch's "
            "GradScaler does)",
        )
    if _is_set(cfg, "gradient_predivide_factor") and (
        cfg.prescale_gradients or cfg.gradient_allreduce_op != "mean"
    ):
        why = (
            "prescale_gradients divides by the world size before the sum"
            if cfg.prescale_gradients
            else 'gradient_allreduce_op "sum" does not average'
        )
        out.append(f"gradient_predivide_factor has no effect: {why}")
    return out


def noted(cfg: DeepSpeedConfig) -> list[str]:
    """One line per NOTED key the config sets."""
    return [
        f"{path} has no effect here: {rule.why}"
        for path, rule in NOTED.items()
        if _is_set(cfg, path, rule.allowed)
    ]


def markdown() -> str:
    """docs/config-support.md: what each listed key does here (a test keeps it current)."""
    lines = [
        "# Config keys this runtime does not run",
        "",
        "Generated from `deepspeed_ext/config/support.py` ([Note: config honesty]); every key "
        "not listed here is honoured. A refused key is an error when set (a section: when "
        "turned on); a noted key set to a value other than its default is reported once; an "
        "inert key is accepted quietly.",
        "",
        "| key | here | why |",
        "|---|---|---|",
    ]
    rows = [(p, "refused", r.why) for p, r in REFUSED.items()]
    rows += [(p, "noted", r.why) for p, r in NOTED.items()]
    rows += [(p, "inert", why) for p, why in INERT.items()]
    rows += [(p, "refused (unknown key)", why) for p, why in NOT_YET.items()]
    lines += [f"| `{p}` | {kind} | {why} |" for p, kind, why in sorted(rows)]
    return "\n".join(lines) + "\n"

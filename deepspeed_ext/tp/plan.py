"""Which layers are sliced, and how: the rules AutoTP training applies to a model.

[Note: slicing rules]
Rules come from one source, the first that applies (upstream's priority, with an explicit
preset counted as the user's own rules):
1. `tensor_parallel.partition_config` (regex layer specs; with `use_default_specs` the preset
   of `preset_model` or of the model's type follows them), or `preset_model` alone;
2. the Hugging Face model's own plan (`model._tp_plan` and `model.config.base_model_tp_plan`:
   colwise, rowwise, colwise_gather_output / colwise_rep);
3. heuristics over module names (attention q/k/v and fused qkv, output projections, MLP up,
   gate, down and fused gate_up), as upstream's parser reads the module structure.
A rule's patterns are regexes matched (re.match) against a parameter name ("...q_proj.weight")
and its module's name. Embeddings stay whole unless the model's plan cuts their vocabulary
(embedding_rowwise), and lm_head unless a rule slices it with a gathered output; a weight tied
between the two is cut once when both are cut, else both stay whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["column", "row", "skip", "column_gather", "vocab"]
_KEY = "tensor_parallel.partition_config"


class PlanError(ValueError):
    """A slicing rule or source that cannot be used, named by its config key."""


@dataclass(frozen=True)
class LayerRule:
    patterns: tuple[str, ...]
    kind: Kind
    # upstream's sub-parameter shape: the entry at partition_dim is a count of equal fused
    # sub-parameters or a list of their sizes; None: not fused
    shape: tuple[Any, ...] | None = None
    partition_dim: int | None = None
    model_types: tuple[str, ...] = ()
    fused_qkv: bool = False  # heuristic: q, k, v sizes come from the model's config
    source: str = ""

    def matches(self, names: tuple[str, ...], model_type: str | None) -> bool:
        if self.model_types and (model_type or "").lower() not in self.model_types:
            return False
        return any(re.match(p, n) for p in self.patterns for n in names)

    def sub_params(self) -> tuple[int, ...] | int | None:
        if self.shape is None:
            return None
        dim = self.partition_dim if self.partition_dim is not None else 0
        entry = self.shape[dim] if dim < len(self.shape) else -1
        if isinstance(entry, (list, tuple)):
            return tuple(int(v) for v in entry)
        return int(entry) if int(entry) > 0 else None


def _rule(patterns: list[str], kind: Kind, source: str, **kw: Any) -> LayerRule:
    return LayerRule(tuple(patterns), kind, source=source, **kw)


def _llama_like(name: str) -> list[LayerRule]:
    src = f"preset {name}"
    return [
        _rule([r".*\.self_attn\.o_proj\.weight$"], "row", src),
        _rule([r".*\.self_attn\.[qkv]_proj\.weight$"], "column", src),
        _rule([r".*\.mlp\.down_proj\.weight$"], "row", src),
        _rule([r".*\.mlp\.(up|gate)_proj\.weight$"], "column", src),
    ]


def preset_rules(name: str) -> list[LayerRule]:
    src = f"preset {name}"
    if name in ("llama", "qwen2", "mistral", "gemma", "gemma2", "qwen3"):
        return _llama_like(name)
    if name in ("bloom", "chatglm"):
        return [
            _rule([r".*\.self_attention\.dense\.weight$"], "row", src),
            _rule([r".*\.self_attention\.query_key_value\.weight$"], "column", src, shape=(3, -1)),
            _rule([r".*\.mlp\.dense_4h_to_h\.weight$"], "row", src),
            _rule([r".*\.mlp\.dense_h_to_4h\.weight$"], "column", src),
        ]
    if name == "mixtral":
        return [
            *_llama_like(name)[:2],
            _rule([r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"], "row", src),
            _rule([r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"], "column", src),
            _rule([r".*\.block_sparse_moe\.gate\.weight$"], "skip", src),
        ]
    if name == "phi3":
        return [
            _rule([r".*\.self_attn\.o_proj\.weight$"], "row", src),
            _rule([r".*\.self_attn\.qkv_proj\.weight$"], "column", src, fused_qkv=True),
            _rule([r".*\.mlp\.down_proj\.weight$"], "row", src),
            _rule([r".*\.mlp\.gate_up_proj\.weight$"], "column", src, shape=(2, -1)),
        ]
    if name == "gpt2":
        return [
            _rule([r".*\.attn\.c_attn\.weight$"], "column", src, fused_qkv=True),
            _rule([r".*\.attn\.c_proj\.weight$", r".*\.mlp\.c_proj\.weight$"], "row", src),
            _rule([r".*\.mlp\.c_fc\.weight$"], "column", src),
        ]
    raise PlanError(
        f"tensor_parallel.preset_model: unknown preset {name!r}; the presets are "
        f"{', '.join(PRESETS)} (or give partition_config layer specs)"
    )


PRESETS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "bloom",
    "chatglm",
    "mixtral",
    "phi3",
    "gpt2",
)

_C = r"(?:^|.*\.)"  # a whole name component
HEURISTICS = [
    _rule([_C + r"(c_attn|qkv_proj|query_key_value|Wqkv|qkv)\.weight$"], "column", "heuristics",
          fused_qkv=True),
    _rule([_C + r"(q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin)\.weight$"], "column",
          "heuristics"),
    _rule([_C + r"(o_proj|out_proj|out_lin|attn\.c_proj|self_attention\.dense|attention\.dense|"
           r"attention\.output\.dense)\.weight$"], "row", "heuristics"),
    _rule([_C + r"gate_up_proj\.weight$"], "column", "heuristics", shape=(2, -1)),
    _rule([_C + r"(up_proj|gate_proj|fc1|c_fc|fc_in|dense_h_to_4h|w1|w3|intermediate\.dense|"
           r"lin1)\.weight$"], "column", "heuristics"),
    _rule([_C + r"(down_proj|fc2|mlp\.c_proj|fc_out|dense_4h_to_h|w2|output\.dense|lin2)"
           r"\.weight$"], "row", "heuristics"),
]  # fmt: skip

_HF_STYLES: dict[str, Kind] = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gather",
    "colwise_rep": "column_gather",
    "embedding_rowwise": "vocab",  # an embedding's vocabulary rows cut
}


def from_partition_config(raw: Mapping[str, Any]) -> tuple[list[LayerRule], bool]:
    """(rules, use_default_specs) from upstream's partition_config dict; every problem is a
    PlanError naming the key."""
    unknown = sorted(set(raw) - {"use_default_specs", "layer_specs", "lm_head_patterns"})
    if unknown:
        raise PlanError(
            f"{_KEY}: unknown key(s) {unknown}; it takes use_default_specs and layer_specs"
        )
    specs = raw.get("layer_specs", [])
    if not isinstance(specs, (list, tuple)):
        raise PlanError(f"{_KEY}.layer_specs: expected a list of specs, got {type(specs).__name__}")
    rules = []
    for i, spec in enumerate(specs):
        where = f"{_KEY}.layer_specs[{i}]"
        if not isinstance(spec, Mapping):
            raise PlanError(f"{where}: expected an object, got {type(spec).__name__}")
        extra = sorted(set(spec) - {"patterns", "partition_type", "shape", "partition_dim",
                                    "model_types"})  # fmt: skip
        if extra:
            raise PlanError(
                f"{where}: unknown key(s) {extra}; a spec takes patterns, partition_type, "
                "shape, partition_dim, model_types"
            )
        patterns = spec.get("patterns")
        if isinstance(patterns, str):
            patterns = [patterns]
        if (
            not isinstance(patterns, (list, tuple))
            or not patterns
            or not all(isinstance(p, str) for p in patterns)
        ):
            raise PlanError(f"{where}.patterns: give a non-empty list of regex strings")
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise PlanError(f"{where}.patterns: {p!r} is not a valid regex ({e})") from None
        kind = str(spec.get("partition_type", "column")).lower()
        if kind not in ("column", "row", "skip"):
            raise PlanError(f'{where}.partition_type: {kind!r}; use "column", "row" or "skip"')
        shape = spec.get("shape")
        dim = spec.get("partition_dim")
        if shape is not None:
            shape = _check_shape(shape, dim, kind, where)
        types = spec.get("model_types") or []
        rules.append(
            LayerRule(
                tuple(patterns),
                kind,  # type: ignore[arg-type]
                shape=shape,
                partition_dim=dim,
                model_types=tuple(str(t).lower() for t in types),
                source=where,
            )
        )
    use_default = raw.get("use_default_specs", True)
    if not isinstance(use_default, bool):
        raise PlanError(f"{_KEY}.use_default_specs: expected true or false, got {use_default!r}")
    return rules, use_default


def _check_shape(shape: Any, dim: Any, kind: str, where: str) -> tuple[Any, ...]:
    if not isinstance(shape, (list, tuple)) or not shape:
        raise PlanError(f"{where}.shape: expected a list such as [2, -1], got {shape!r}")
    pdim = dim if dim is not None else (0 if kind == "column" else 1)
    if not isinstance(pdim, int) or not 0 <= pdim < len(shape):
        raise PlanError(f"{where}.partition_dim: {dim!r} is not a dim of shape {list(shape)}")
    out: list[Any] = []
    for i, entry in enumerate(shape):
        if isinstance(entry, (list, tuple)):
            if i != pdim or not entry or not all(isinstance(v, int) and v > 0 for v in entry):
                raise PlanError(
                    f"{where}.shape: a list of sub-parameter sizes (positive integers) is "
                    f"allowed only at partition_dim ({pdim}), got {list(shape)}"
                )
            out.append(tuple(entry))
        elif isinstance(entry, int) and (entry > 0 or entry == -1):
            out.append(entry)
        else:
            raise PlanError(f"{where}.shape: entries are positive integers or -1, got {entry!r}")
    return tuple(out)


def from_hf_plan(model: Any) -> list[LayerRule] | None:
    """The model's own tensor-parallel plan as rules; None without one, or when it uses a
    style not built here (then the heuristics apply). Vocabulary-parallel embeddings
    (embedding_rowwise) and "replicate" entries leave the module whole."""
    cfg = getattr(model, "config", None)
    base = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    top = dict(getattr(model, "_tp_plan", None) or {})
    if not base and not top:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    rules = []
    for plan, under in ((top, ""), (base, prefix)):
        for key, style in plan.items():
            kind = _HF_STYLES.get(str(style))
            if kind is None and style == "replicate":
                kind = "skip"
            if kind is None:
                return None
            body = re.escape(key).replace(r"\*", r"[^.]+")
            scope = rf"(?:.*\.)?(?:{re.escape(under)}\.)?" if under else r"(?:.*\.)?"
            rules.append(_rule([rf"^{scope}{body}(?:\.weight)?$"], kind, "the model's tp_plan"))
    return rules


def choose(
    model: Any, partition_config: dict[str, Any] | None, preset: str | None
) -> list[LayerRule]:
    """The rules for this model ([Note: slicing rules])."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if partition_config is not None:
        rules, use_default = from_partition_config(partition_config)
        if use_default:
            name = preset or model_type
            if name in PRESETS:
                rules += preset_rules(name)
            elif preset is None:
                rules += HEURISTICS
        return rules
    if preset is not None:
        return preset_rules(preset)
    hf = from_hf_plan(model)
    if hf is not None:
        return hf
    return HEURISTICS


def first_match(
    rules: list[LayerRule], names: tuple[str, ...], model_type: str | None
) -> LayerRule | None:
    for rule in rules:
        if rule.matches(names, model_type):
            return rule
    return None

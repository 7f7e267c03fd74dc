"""[Note: config honesty]: every key the config accepts is read by the runtime, refused by
name, or (speed-only / inert) listed with the reason; the runtime's reads are recorded in a
spawned rank that trains, saves and loads under configs setting the honoured keys."""

from __future__ import annotations

from typing import Any

import pytest

from deepspeed_ext.config import ConfigError, parse, support
from deepspeed_ext.config.types import Section
from tests.helpers.distributed import run_ranks

from . import honesty_runs

# A value other than the default for keys whose sample cannot be derived from the type.
SAMPLES: dict[str, Any] = {
    "compile": {"deepcompile": True},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}},
    "sparse_attention": {"mode": "fixed"},
    "gradient_compression.algorithm": "topk",
    "gradient_compression.topk_ratio": 0.5,
    "tensor_parallel.dtype": "bf16",
    "tensor_parallel.vocab_parallel_ce_backend": "liger",
    "tensor_parallel.vocab_parallel_lm_head": True,
    "weight_quantization": {},
    "zero_optimization.zenflow": {"topk_ratio": 0.05},
    "datastates_ckpt": True,
    "sequence_parallel_size": 2,
    "communication_data_type": "fp16",
    "data_types.param_dtype": "bf16",
    "data_types.buffer_dtype": "bf16",
    "data_types.keep_in_fp32_modules": ["norm"],
    "checkpoint.writer.type": "mock",
    "zero_optimization.mics_shard_size": 2,
    "zero_optimization.zero_hpz_partition_size": 2,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8},
    "zero_optimization.offload_optimizer.ratio": 0.5,
    "zero_optimization.offload_optimizer.super_offload": True,
    "torch_autocast.lower_precision_safe_modules": ["torch.nn.Linear"],
}
# Keys whose refusal needs another key set as well.
CONTEXT: dict[str, dict[str, Any]] = {
    "zero_optimization.offload_optimizer.ratio": {"zero_optimization": {"stage": 3}},
    "zero_optimization.offload_optimizer.super_offload": {},
}


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    here = out
    parts = path.split(".")
    for part in parts[:-1]:
        here = here.setdefault(part, {})
    here[parts[-1]] = value
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _field(path: str) -> Any:
    cls: Any = None
    from deepspeed_ext.config.model import DeepSpeedConfig

    owner: Any = DeepSpeedConfig
    for part in path.split("."):
        cls, field = owner, owner.model_fields[part]
        owner = support._section_type(field.annotation)
    return cls.model_fields[path.rsplit(".", 1)[-1]]


def _sample(path: str) -> Any:
    if path in SAMPLES:
        return SAMPLES[path]
    field = _field(path)
    if support._section_type(field.annotation) is not None:
        return {"enabled": True}
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    raise AssertionError(f"add a sample value for {path} to SAMPLES")


def _offload_parent(path: str) -> dict[str, Any]:
    """Keys inside an optional offload section need the section there."""
    if ".offload_optimizer." in path:
        return {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    return {}


def _config_setting(path: str) -> dict[str, Any]:
    cfg = _merge(_offload_parent(path), CONTEXT.get(path, {}))
    if path.startswith("checkpoint.writer."):
        cfg = _merge(cfg, {"checkpoint": {"writer": {}}})
    return _merge(cfg, _nest(path, _sample(path)))


@pytest.mark.parametrize("path", sorted(support.REFUSED))
def test_a_refused_key_is_an_error_that_names_it(path: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(_config_setting(path))
    assert any(p.startswith(f"{path}:") and "remove " in p for p in e.value.problems), e.value


@pytest.mark.parametrize("path", sorted(support.REFUSED))
def test_a_refused_key_at_its_default_is_accepted(path: str) -> None:
    field = _field(path)
    if support._section_type(field.annotation) is not None:
        return  # a section left off: covered by every other config
    default = field.get_default(call_default_factory=True)
    if isinstance(default, tuple):
        default = list(default)
    parse(_merge(_offload_parent(path), _nest(path, default)))


@pytest.mark.parametrize("path", sorted(support.NOTED))
def test_a_noted_key_set_is_said_once_by_name(path: str) -> None:
    sample = {"checkpoint.writer": {}}
    if path in sample:
        cfg = _nest(path, sample[path])
    else:
        field = _field(path)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, bool):
            value: Any = not default
        elif default is None:  # a bool resolved later: the value the runtime does not run
            value = True not in (support.NOTED[path].allowed or ())
        elif isinstance(default, float) and 0 < default <= 1:
            value = default / 2
        elif isinstance(default, (int, float)):
            value = default * 2 + 1
        else:
            raise AssertionError(f"no sample for {path}")
        cfg = _merge(_offload_parent(path), _nest(path, value))
    lines = support.noted(parse(cfg))
    assert [line for line in lines if line.startswith(f"{path} has no effect")], lines


def test_every_config_key_is_read_by_the_runtime_or_classified() -> None:
    reads = {tuple(r) for r in run_ranks(honesty_runs.exercise, 1, timeout=300)[0]}
    unclassified = [
        path
        for path, owner, name in support.leaf_fields()
        if (owner.__name__, name) not in reads and support.covered(path) is None
    ]
    assert unclassified == [], (
        "config keys neither read by the runtime nor listed in deepspeed_ext/config/support.py "
        f"(honour them, or refuse them there): {unclassified}"
    )
    # a listed key the runtime reads anyway is a stale entry (a REFUSED one may be read only
    # to refuse it, which the config parser does already)
    stale = [
        path
        for path, owner, name in support.leaf_fields()
        if (owner.__name__, name) in reads and support.covered(path) in ("NOTED", "INERT")
    ]
    assert stale == [], f"listed as unused in support.py but read by the runtime: {stale}"


def test_sections_the_registry_names_exist() -> None:
    paths = {p for p, _, _ in support.leaf_fields()}
    for name in [*support.REFUSED, *support.NOTED, *support.INERT, *support.PARSER_KEYS]:
        assert name in paths or any(p.startswith(name + ".") for p in paths), name


def test_a_section_entry_is_refused_only_when_turned_on() -> None:
    parse({"eigenvalue": {"enabled": False, "max_iter": 3}})
    with pytest.raises(ConfigError, match="eigenvalue: eigenvalue-based .* removed upstream"):
        parse({"eigenvalue": {"enabled": True}})
    assert isinstance(parse({}).eigenvalue, Section)


def test_the_docs_list_is_current() -> None:
    from pathlib import Path

    doc = Path(__file__).resolve().parents[3] / "docs" / "config-support.md"
    assert doc.read_text() == support.markdown(), (
        "docs/config-support.md is stale: regenerate it with python -c 'from deepspeed_ext."
        'config import support; open("docs/config-support.md", "w").write(support.markdown())\''
    )


def test_pipeline_keys_on_a_plain_model_are_said_by_name(monkeypatch: Any) -> None:
    """A plain model's engine reads no pipeline key: those set are said once, by name."""
    from deepspeed_ext.runtime import config_effects

    cfg = parse(
        {
            "pipeline": {"schedule": "zb-h1", "partition": "best", "stages": "auto"},
            "checkpoint": {"parallel_write": {"pipeline_stage": True}},
        }
    )
    assert support.pipeline_only_set(cfg) == [
        "pipeline.schedule",
        "checkpoint.parallel_write.pipeline_stage",
    ]
    assert support.pipeline_only_set(parse({"pipeline": {"partition": "best"}})) == []
    said: list[str] = []
    monkeypatch.setattr(config_effects.logger, "warning", said.append)
    config_effects.at_start(cfg, pipeline=True)
    assert said == []
    config_effects.at_start(cfg, pipeline=False)
    assert len(said) == 1 and said[0].startswith(
        "pipeline.schedule, checkpoint.parallel_write.pipeline_stage have no effect: the model "
        "is not a pipeline"
    ), said


def test_keys_the_user_did_not_give_are_never_noted() -> None:
    assert support.noted(parse({})) == []
    assert support.noted(parse({"zero_optimization": {"stage": 3, "overlap_comm": True}})) == []


@pytest.mark.parametrize("key", sorted(support.NOT_YET))
def test_keys_of_features_not_built_are_named_not_misspelt(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse({key: 2})
    assert e.value.problems == [f"{key}: {support.NOT_YET[key]}; remove it"]


@pytest.mark.parametrize(
    ("zero", "said"),
    [
        (
            {"stage": 2, "stage3_max_live_parameters": 10, "sub_group_size": 100},
            "zero_optimization.stage3_max_live_parameters, zero_optimization.sub_group_size "
            "have no effect at zero_optimization.stage 2",
        ),
        (
            {"stage": 1, "offload_param": {"device": "cpu"}},
            "zero_optimization.offload_param has no effect at zero_optimization.stage 1",
        ),
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            "zero_optimization.offload_optimizer has no effect at zero_optimization.stage 0",
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_read": True}},
            'offload_optimizer.pipeline_read has no effect with offload_optimizer.device "cpu"',
        ),
    ],
)
def test_keys_of_another_stage_are_said_by_name(zero: dict[str, Any], said: str) -> None:
    """Keys only stage 3 (or NVMe offload) reads, set where nothing reads them, were
    accepted unsaid (found by fuzzing helpers)."""
    (line,) = support.stage_mismatched(parse({"zero_optimization": zero}))
    assert said in line, line


def test_keys_of_the_stage_in_use_are_not_said() -> None:
    z3 = {"stage": 3, "stage3_max_live_parameters": 10, "offload_param": {"device": "cpu"}}
    assert support.stage_mismatched(parse({"zero_optimization": z3})) == []
    z2 = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert support.stage_mismatched(parse({"zero_optimization": z2})) == []

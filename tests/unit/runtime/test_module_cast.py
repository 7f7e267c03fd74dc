"""[Note: module cast]: under fp16 / bf16 the parameters take the training dtype and the
buffers keep theirs, unless data_types.buffer_dtype names one; data_types.keep_in_fp32_modules
("auto": the model's Hugging Face lists) keeps buffers in fp32 either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from deepspeed_ext.runtime.precision.module_cast import cast_module, keep_pattern
from tests.helpers.distributed import run_ranks


class _Rotary(nn.Module):
    _keep_in_fp32_modules_strict = ["inv"]  # a Hugging Face model's own list
    _keep_in_fp32_modules = ["other"]  # ... for fp16 only

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32) / 3)
        self.register_buffer("other", torch.ones(4))
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))
        self.lin = nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot = _Rotary()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("top", torch.ones(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.rot.lin(x) * self.rot.inv_freq.to(x.dtype))


def _dtypes(m: nn.Module) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in [*m.named_buffers(), *m.named_parameters()]}


BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def test_parameters_take_the_training_dtype_and_buffers_keep_theirs() -> None:
    m = _Model()
    cast_module(m, BF, None, "auto")
    d = _dtypes(m)
    assert {d[n] for n, _ in m.named_parameters()} == {BF}
    assert d["rot.inv_freq"] == d["rot.other"] == F32
    assert d["top"] == torch.float64 and d["rot.count"] == torch.int64
    # beyond upstream: a batch norm's statistics with its weights (torch's norm takes one dtype)
    assert d["norm.running_mean"] == d["norm.running_var"] == BF


@pytest.mark.parametrize(
    ("dtype", "keep", "kept"),
    [
        (BF, "auto", {"rot.inv_freq"}),  # the strict list only under bf16
        (F16, "auto", {"rot.inv_freq", "rot.other"}),  # both lists under fp16
        (BF, ["other", "norm.*mean"], {"rot.other"}),  # patterns (a norm's stats: bf16)
        (BF, [], set()),
    ],
)
def test_buffer_dtype_casts_every_floating_buffer_but_the_kept(
    dtype: torch.dtype, keep: Any, kept: set[str]
) -> None:
    m = _Model()
    m.rot.other.data = m.rot.other.data.to(dtype)  # a listed buffer arriving in 16 bits: upcast
    cast_module(m, dtype, dtype, keep)
    d = _dtypes(m)
    stats = {"norm.running_mean", "norm.running_var"}  # always their weights' dtype
    assert {d[n] for n in stats} == {dtype}
    floating = {n for n, b in m.named_buffers() if b.is_floating_point()} - stats
    assert {n for n in floating if d[n] == F32} == kept
    assert all(d[n] == dtype for n in floating - kept)
    assert d["rot.count"] == torch.int64


def test_nothing_is_kept_under_fp32_training() -> None:
    assert keep_pattern(_Model(), "auto", F32) is None


def _train_bf16(extra: dict[str, Any]) -> dict[str, Any]:
    import deepspeed

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True},
        **extra,
    }
    engine, *_ = deepspeed.initialize(model=_Model(), config=config)
    for _ in range(2):
        x = torch.randn(8, 4, dtype=BF)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return _dtypes(engine.module)


def test_the_engine_casts_by_the_config() -> None:
    plain = run_ranks(_train_bf16, 1, {})[0]  # trains: the norm's statistics are bf16
    assert plain["rot.other"] == F32 and plain["rot.lin.weight"] == BF
    both = run_ranks(_train_bf16, 1, {"data_types": {"buffer_dtype": "bf16"}})[0]
    assert both["rot.other"] == BF and both["rot.inv_freq"] == F32  # the model's list


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}},
            'data_types.param_dtype "fp16" conflicts',
        ),
        ({"data_types": {"buffer_dtype": "bf16"}}, "data_types.buffer_dtype casts the buffers"),
    ],
)
def test_dtypes_the_model_cannot_take_are_refused(config: dict[str, Any], words: str) -> None:
    from deepspeed_ext.config import parse

    with pytest.raises(Exception, match=words):
        parse({"train_batch_size": 8, **config})
    parse({"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}})


def test_a_norms_statistics_follow_its_weights_whatever_buffer_dtype_says() -> None:
    m = _Model()
    cast_module(m, BF, F32, "auto")
    assert m.norm.running_mean.dtype == m.norm.weight.dtype == BF
    m(torch.randn(8, 4, dtype=BF))  # torch's norm takes one dtype


def test_a_shared_buffer_is_kept_under_either_name() -> None:
    m = nn.Module()
    m.a, m.b = nn.Module(), nn.Module()
    shared = torch.full((2,), 1 / 3)
    m.a.register_buffer("sh", shared)
    m.b.register_buffer("sh", shared)
    cast_module(m, BF, BF, ["a.sh"])
    assert m.a.sh is m.b.sh and m.b.sh.dtype == F32


def test_a_bad_keep_pattern_names_the_key() -> None:
    with pytest.raises(ValueError, match="data_types.keep_in_fp32_modules: .* not a valid"):
        keep_pattern(_Model(), ["b(b"], BF)


class _Made(nn.Module):
    """Buffers made as models make them, inside zero.Init."""

    _keep_in_fp32_modules_strict = ["kept"]

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ones", torch.ones(4))  # a constructor: the Init's dtype
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))
        self.register_buffer("grid", torch.linspace(0, 1, 3, dtype=torch.float64))
        self.register_buffer("kept", torch.zeros(2))  # the model's list: back to fp32


def _made_under_init() -> dict[str, torch.dtype]:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    config["zero_optimization"] = {"stage": 3}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        m = _Made()
    made = {n: b.dtype for n, b in m.named_buffers()}
    assert torch.ones(1).dtype == F32  # the constructors are torch's again
    engine, *_ = deepspeed.initialize(model=m, config=config)
    assert {n: b.dtype for n, b in engine.module.named_buffers()} == made  # the engine agrees
    return made


def test_zero_init_makes_constructed_tensors_in_its_dtype_as_upstreams() -> None:
    made = run_ranks(_made_under_init, 1)[0]
    assert made == {"ones": BF, "inv_freq": F32, "grid": torch.float64, "kept": F32}, made


def _inside_init() -> dict[str, Any]:
    import deepspeed
    from deepspeed_ext.zero.stage3.init import torch_constructors

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Module()
            self.layer.rot = nn.Module()
            self.layer.rot.register_buffer("f", torch.ones(2))  # a constructor's: bf16

    out: dict[str, Any] = {}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "data_types": {"keep_in_fp32_modules": ["^rot"]},  # anchored: the full name
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        out["explicit"] = torch.zeros(1, dtype=torch.float64).dtype  # as upstream's Init
        out["leaf"] = torch.zeros(2, requires_grad=True).is_leaf
        with torch_constructors():
            out["own"] = torch.zeros(1, dtype=torch.float64).dtype
        out["nested_f"] = Nested().layer.rot.f.dtype  # "^rot" names no full name here
    plain = nn.Linear(4, 4)  # built outside; initialize called inside an Init
    with deepspeed.zero.Init(dtype=torch.bfloat16):
        zero2 = {**config, "zero_optimization": {"stage": 2}}
        engine, *_ = deepspeed.initialize(model=plain, config=zero2)
    out["masters"] = {m.dtype for g in engine.strategy.groups for m in g.masters}
    return out


def test_inside_zero_init_the_packages_own_code_keeps_its_dtypes() -> None:
    out = run_ranks(_inside_init, 1)[0]
    assert out["explicit"] == BF and out["own"] == torch.float64 and out["leaf"]
    assert out["nested_f"] == BF
    assert out["masters"] == {F32}

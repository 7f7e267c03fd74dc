"""Slicing arithmetic, slicing rules and the tensor_parallel config keys (no process group)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.config import ConfigError, parse, validate_config_file
from deepspeed_ext.tp import PlanError, SliceError, TensorSlice, plan


@pytest.mark.parametrize("dim", [0, 1])
def test_fused_slices_make_the_whole_again(dim: int) -> None:
    shape = (16, 6) if dim == 0 else (6, 16)
    full = torch.arange(96.0).reshape(shape)
    specs = [TensorSlice.plan("w", shape, dim, (8, 4, 4), 2, r, granule=2) for r in range(2)]
    slices = [s.local(full) for s in specs]
    assert slices[0].shape == specs[0].local_shape
    # rank 0 holds the first half of each sub-parameter: q rows 0-3, k rows 8-9, v rows 12-13
    rows = torch.cat([torch.arange(0, 4), torch.arange(8, 10), torch.arange(12, 14)])
    assert torch.equal(slices[0], full.index_select(dim, rows))
    assert torch.equal(specs[0].full(slices), full)


def test_equal_sub_parameters_by_count() -> None:
    spec = TensorSlice.plan("gate_up", (8, 3), 0, 2, 2, 1)
    assert spec.parts == (4, 4) and spec.local_shape == (4, 3)


def test_uneven_cuts_name_the_weight_and_the_key() -> None:
    with pytest.raises(SliceError, match=r"k_proj.weight: 1 attention head cannot be split .*"
                       r"autotp_size"):  # fmt: skip
        TensorSlice.plan("k_proj.weight", (8, 32), 0, None, 2, 0, granule=8)
    with pytest.raises(SliceError, match="add up to 10"):
        TensorSlice.plan("qkv.weight", (12, 4), 0, (8, 1, 1), 2, 0)


def test_partition_config_problems_name_their_key() -> None:
    key = "tensor_parallel.partition_config.layer_specs[0]"
    bad = [
        ({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]},
         f"{key}.partition_type"),
        ({"layer_specs": [{"patterns": ["("]}]}, f"{key}.patterns"),
        ({"layer_specs": [{"patterns": []}]}, f"{key}.patterns"),
        ({"layer_specs": [{"patterns": ["x"], "shpe": [2, -1]}]}, f"{key}: unknown key"),
        ({"layer_specs": [{"patterns": ["x"], "shape": [-1, [4, 4]]}]}, f"{key}.shape"),
        ({"layerspecs": []}, "unknown key"),
    ]  # fmt: skip
    for raw, where in bad:
        with pytest.raises(PlanError, match=where.replace("[", r"\[").replace("]", r"\]")):
            plan.from_partition_config(raw)


def test_partition_config_rules_parse_upstreams_example() -> None:
    rules, use_default = plan.from_partition_config(
        {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.qkv_proj\.weight$"], "shape": [[8, 4, 4], -1]},
                {"patterns": [r".*\.gate_up_proj\.weight$"], "shape": [2, -1], "partition_dim": 0},
            ],
        }
    )
    assert not use_default
    assert [r.kind for r in rules] == ["row", "column", "column"]
    assert rules[1].sub_params() == (8, 4, 4) and rules[2].sub_params() == 2


@pytest.mark.parametrize(
    "name, kind",
    [
        ("transformer.h.3.attn.c_attn", "column"),
        ("transformer.h.3.attn.c_proj", "row"),
        ("transformer.h.3.mlp.c_fc", "column"),
        ("transformer.h.3.mlp.c_proj", "row"),
        ("bert.encoder.layer.0.attention.self.query", "column"),
        ("bert.encoder.layer.0.attention.output.dense", "row"),
        ("bert.encoder.layer.0.intermediate.dense", "column"),
        ("bert.encoder.layer.0.output.dense", "row"),
        ("model.layers.0.mlp.gate_up_proj", "column"),
        ("lm_head", None),
        ("transformer.wte", None),
    ],
)
def test_heuristics_read_module_names(name: str, kind: str | None) -> None:
    rule = plan.first_match(plan.HEURISTICS, (f"{name}.weight", name), None)
    assert (rule.kind if rule else None) == kind


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(
        PlanError, match="tensor_parallel.preset_model: unknown preset 'lama'.*llama"
    ):
        plan.choose(torch.nn.Linear(2, 2), None, "lama")


def _cfg(**extra: object) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **extra}


def test_tensor_model_parallel_size_is_an_alias() -> None:
    cfg = parse(_cfg(tensor_model_parallel_size=2))
    assert cfg.tensor_parallel.autotp_size == 2


def test_batch_is_per_data_parallel_rank_before_spawn() -> None:
    # 8 ranks at tensor size 2: 4 data-parallel ranks x micro 2 -> accumulation 1
    validate_config_file(_cfg(tensor_parallel={"autotp_size": 2}), 8)
    with pytest.raises(ConfigError, match="not a multiple of the 2 ranks"):
        validate_config_file(_cfg(tensor_parallel={"autotp_size": 2}), 3)
    with pytest.raises(ConfigError, match=r"train_batch_size"):
        validate_config_file(_cfg(tensor_parallel={"autotp_size": 2}), 16)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
         "offload_param needs zero_optimization.stage 3, which runs as stage 2"),
        ({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}},
         "tensor_parallel.vocab_parallel_lm_head"),
        ({"tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}}, "tensor_parallel.dtype"),
        ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
         "tensor_parallel.tp.tp_size"),
    ],
)  # fmt: skip
def test_what_autotp_does_not_do_is_refused_by_name(extra: dict, key: str) -> None:
    raw = _cfg(**{"tensor_parallel": {"autotp_size": 2}, **extra})
    with pytest.raises(ConfigError, match=key):
        parse(raw)


def test_matching_dtype_and_tp_size_are_accepted() -> None:
    tp = {"autotp_size": 2, "dtype": "bf16", "tp": {"tp_size": 2}}
    parse(_cfg(tensor_parallel=tp, bf16={"enabled": True}))


def test_tp_model_init_records_and_must_agree_with_the_config() -> None:
    import deepspeed
    from deepspeed_ext.runtime import tensor_parallel

    model = deepspeed.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    assert tensor_parallel.tp_size(parse(_cfg()), model) == 2  # from tp_model_init alone
    both = parse(_cfg(tensor_parallel={"autotp_size": 4}))
    with pytest.raises(
        ValueError, match=r"autotp_size is 4 but deepspeed.tp_model_init\(tp_size=2"
    ):
        tensor_parallel.tp_size(both, model)
    bf16 = parse(_cfg(bf16={"enabled": True}))
    with pytest.raises(ValueError, match="dtype=torch.float32.*trains in torch.bfloat16"):
        tensor_parallel.tp_size(bf16, model)
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        deepspeed.tp_model_init(torch.nn.Linear(2, 2), tp_size=0, dtype=None)


def test_the_copy_to_cache_is_dropped_before_the_groups_at_exit() -> None:
    """The shared copy_to output pins its tensor group (through its autograd node): the
    exit handler must drop it before destroying the groups, or gloo's threads reach
    interpreter teardown (a finished AutoTP job exited 134)."""
    from deepspeed_ext.comm import init
    from deepspeed_ext.tp import collectives

    assert collectives._last.clear in init._release_at_exit
    collectives._last[0] = (None, 0, torch.zeros(1))  # type: ignore[assignment]
    init._destroy_at_exit()  # no process group here: only the releases and forget_groups
    assert collectives._last == {}

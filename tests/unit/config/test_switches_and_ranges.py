"""Switches nested where the section's own `enabled` does not show them, values that would
break training later (a scale that never drops, a zero divisor, I/O depths of 0), and keys
another setting leaves unread: each refused or said when the config is read."""

from __future__ import annotations

from typing import Any

import pytest

from deepspeed_ext.config import ConfigError, parse, support

BASE = {"train_batch_size": 1}


@pytest.mark.parametrize(
    ("section", "path"),
    [
        (
            {"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}},
            "data_efficiency",
        ),
        (
            {"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}},
            "data_efficiency",
        ),
        ({"data_efficiency": {"data_sampling": {"enabled": True}}}, "data_efficiency"),
        (
            {
                "compression_training": {
                    "weight_quantization": {"shared_parameters": {"enable": True}}
                }
            },
            "compression_training",
        ),
    ],
)
def test_nested_and_misspelt_switches_of_unbuilt_sections_are_refused(section, path):
    with pytest.raises(ConfigError, match=f"{path}: .*(not built yet|removed upstream)"):
        parse({**BASE, **section})


@pytest.mark.parametrize(
    ("section", "words"),
    [
        (
            {"fp16": {"enabled": True, "hysteresis": 0}},
            "fp16.hysteresis: expected a value of at least 1",
        ),
        ({"fp16": {"enabled": True, "initial_scale_power": 200}}, "fp16.initial_scale_power"),
        ({"aio": {"queue_depth": 0}}, "aio.queue_depth"),
        ({"aio": {"block_size": -1}}, "aio.block_size"),
        ({"aio": {"intra_op_parallelism": 0}}, "aio.intra_op_parallelism"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor: expected a value greater"),
        (
            {"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
            'optimizer.params.adam_w_mode is false but optimizer.type "AdamW"',
        ),
    ],
)
def test_values_that_break_training_later_are_refused_by_name(section, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse({**BASE, **section})


def test_an_alias_given_with_its_key_is_one_problem_not_two():
    zero = {"stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6}
    with pytest.raises(ConfigError) as e:
        parse({**BASE, "zero_optimization": zero})
    assert "both given" in str(e.value) and "unknown key" not in str(e.value)


def test_switched_off_sections_of_unbuilt_features_are_accepted():
    parse({**BASE, "datastates_ckpt": {"enabled": False}})
    parse({**BASE, "datastates_ckpt": {}})
    with pytest.raises(ConfigError, match="datastates_ckpt"):
        parse({**BASE, "datastates_ckpt": {"enabled": True}})


def test_a_refusal_that_names_its_own_fix_does_not_repeat_it():
    with pytest.raises(ConfigError) as e:
        parse({**BASE, "tensor_parallel": {"dtype": "bf16"}})
    assert "remove it; remove it" not in str(e.value) and "(or set it to" not in str(e.value)


def _said(config: dict[str, Any]) -> str:
    return " | ".join(support.stage_mismatched(parse({**BASE, **config})))


@pytest.mark.parametrize(
    ("config", "keys"),
    [
        (
            {"zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_scatter": False}},
            ["zero_optimization.overlap_comm", "zero_optimization.reduce_scatter"],
        ),
        ({"zero_optimization": {"stage": 3, "sub_group_size": 1000}}, ["sub_group_size"]),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu", "buffer_count": 9},
                }
            },
            ["offload_param.buffer_count"],
        ),
        ({"aio": {"queue_depth": 4}}, ["aio.queue_depth"]),
        ({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4}}, ["fp16.hysteresis"]),
        (
            {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
            ["gradient_predivide_factor has no effect"],
        ),
    ],
)
def test_keys_another_setting_leaves_unread_are_said(config, keys):
    said = _said(config)
    for k in keys:
        assert k in said, said


def test_keys_that_act_are_not_said():
    assert _said({"zero_optimization": {"stage": 2, "overlap_comm": True}}) == ""
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    assert "aio" not in _said(
        {"zero_optimization": {"stage": 3, "offload_optimizer": nvme}, "aio": {"queue_depth": 4}}
    )
    assert _said({"fp16": {"enabled": True, "hysteresis": 4}}) == ""
    assert _said({"gradient_predivide_factor": 2.0}) == ""

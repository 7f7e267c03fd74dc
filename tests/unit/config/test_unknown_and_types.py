"""Typos and wrong types: full key path, a suggestion, the value and what was expected; all
problems in one exception."""

import warnings

import pytest

from deepspeed_ext.config import ConfigError, ConfigWarning, parse


def _problems(cfg):
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    return e.value.problems, str(e.value)


def test_top_level_typo_names_key_and_suggests():
    problems, _ = _problems({"train_batch_sise": 8})
    assert problems == ['train_batch_sise: unknown key; did you mean "train_batch_size"?']


def test_nested_typo_names_full_path_and_suggests():
    problems, _ = _problems({"zero_optimization": {"stage": 2, "offload_optimzer": {}}})
    assert problems == [
        'zero_optimization.offload_optimzer: unknown key; did you mean "offload_optimizer"?'
    ]
    problems, _ = _problems({"zero_optimization": {"offload_param": {"devce": "cpu"}}})
    assert problems == [
        'zero_optimization.offload_param.devce: unknown key; did you mean "device"?'
    ]


def test_unknown_key_without_a_close_match():
    problems, _ = _problems({"fp16": {"xyzzy": 1}})
    assert problems == ["fp16.xyzzy: unknown key"]


def test_wrong_types_name_path_value_and_expected_type():
    problems, _ = _problems(
        {
            "fp16": {"enabled": "yes", "initial_scale_power": 2.5},
            "zero_optimization": {"stage": "two", "reduce_bucket_size": 0},
            "optimizer": {"type": 3, "params": []},
            "steps_per_print": True,
        }
    )
    assert set(problems) == {
        "fp16.enabled: expected a boolean (true or false), got 'yes' (str)",
        "fp16.initial_scale_power: expected an integer, got 2.5 (float)",
        "zero_optimization.stage: expected an integer, got 'two' (str)",
        "zero_optimization.reduce_bucket_size: expected a value greater than 0, got 0 (int)",
        "optimizer.type: expected a string, got 3 (int)",
        "optimizer.params: expected an object ({...}), got [] (list)",
        "steps_per_print: expected an integer, got true",
    }


def test_choices_are_listed():
    problems, _ = _problems({"zero_optimization": {"stage": 4}, "communication_data_type": "fp8"})
    assert set(problems) == {
        "zero_optimization.stage: expected one of 0, 1, 2 or 3, got 4 (int)",
        "communication_data_type: expected one of 'fp32', 'fp16' or 'bf16', got 'fp8' (str)",
    }


def test_all_problems_in_one_message():
    problems, text = _problems({"trian_batch_size": 1, "fp16": {"enabled": 1}, "bf16": []})
    assert len(problems) == 3
    assert text.startswith("invalid DeepSpeed config (<dict>): 3 problems:")
    assert all(p in text for p in problems)


def test_json_spellings_of_numbers_are_accepted():
    cfg = parse(
        {
            "zero_optimization": {"stage": 3.0, "reduce_bucket_size": 5e8, "sub_group_size": 1e9},
            "gradient_clipping": 1,  # an int where a float is expected
        }
    )
    z = cfg.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.sub_group_size) == (3, 500_000_000, 1_000_000_000)
    assert isinstance(z.reduce_bucket_size, int) and cfg.gradient_clipping == 1.0


def test_names_are_normalised_as_upstream_does():
    cfg = parse(
        {
            "communication_data_type": "FP32",
            "data_types": {"grad_accum_dtype": "torch.float32"},
            "checkpoint": {"tag_validation": "Fail"},
            "zero_optimization": {"offload_optimizer": {"device": "CPU"}},
        }
    )
    assert cfg.communication_data_type == "fp32"
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert cfg.checkpoint.tag_validation == "FAIL"
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_strict_false_turns_unknown_keys_into_one_warning():
    with pytest.warns(ConfigWarning) as record:
        cfg = parse(
            {"strict": False, "train_batch_sise": 8, "fp17": {}, "zero_optimization": {"stag": 1}}
        )
    assert len(record) == 1
    text = str(record[0].message)
    assert "3 unknown key(s)" in text
    for part in (
        'train_batch_sise (did you mean "train_batch_size"?)',
        "fp17",
        "zero_optimization.stag",
    ):
        assert part in text
    assert cfg.zero_optimization.stage == 0 and cfg.train_batch_size is None
    with warnings.catch_warnings():  # filling values later does not warn again
        warnings.simplefilter("error")
        cfg.with_values({"train_batch_size": 8})


def test_strict_false_still_rejects_wrong_types():
    with pytest.raises(ConfigError, match="fp16.enabled: expected a boolean"):
        parse({"strict": False, "fp16": {"enabled": "no"}})

"""Upstream's deprecated keys map onto the new ones, with one warning each naming the new key."""

import warnings

import pytest

from deepspeed_ext.config import ConfigError, DeprecatedConfigKeyWarning, parse


def _parse_warning_once(cfg, new_key):
    with pytest.warns(DeprecatedConfigKeyWarning) as record:
        out = parse(cfg)
    assert len(record) == 1, [str(r.message) for r in record]
    assert new_key in str(record[0].message)
    return out


def test_bfloat16_section():
    cfg = _parse_warning_once({"bfloat16": {"enabled": True}}, '"bf16"')
    assert cfg.bf16.enabled


def test_boolean_zero_optimization():
    cfg = _parse_warning_once({"zero_optimization": True}, "zero_optimization")
    assert cfg.zero_optimization.stage == 1
    cfg = _parse_warning_once({"zero_optimization": False}, "zero_optimization")
    assert cfg.zero_optimization.stage == 0


def test_allgather_size():
    cfg = _parse_warning_once({"allgather_size": 2e8}, "zero_optimization.allgather_bucket_size")
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000


def test_cpu_offload():
    z = _parse_warning_once(
        {"zero_optimization": {"stage": 2, "cpu_offload": True}},
        "zero_optimization.offload_optimizer",
    ).zero_optimization
    assert z.offload_optimizer is not None and z.offload_optimizer.device == "cpu"
    z = _parse_warning_once(
        {"zero_optimization": {"cpu_offload": False}}, "zero_optimization.offload_optimizer"
    ).zero_optimization
    assert z.offload_optimizer is None


def test_cpu_offload_params():
    z = _parse_warning_once(
        {"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
        "zero_optimization.offload_param",
    ).zero_optimization
    assert z.offload_param is not None and z.offload_param.device == "cpu"


def test_cpu_offload_use_pin_memory():
    with pytest.warns(DeprecatedConfigKeyWarning) as record:
        cfg = parse(
            {
                "zero_optimization": {
                    "stage": 3,
                    "cpu_offload": True,
                    "offload_param": {"device": "cpu", "pin_memory": True},
                    "cpu_offload_use_pin_memory": False,
                }
            }
        )
    messages = [str(r.message) for r in record]
    assert len(messages) == 2  # one for cpu_offload, one for cpu_offload_use_pin_memory
    assert any("offload_optimizer.pin_memory" in m for m in messages)
    z = cfg.zero_optimization
    assert z.offload_optimizer.pin_memory is False  # set through the deprecated key
    assert z.offload_param.pin_memory is True  # explicit value wins


def test_stage3_gather_fp16_weights_on_model_save():
    z = _parse_warning_once(
        {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
        "stage3_gather_16bit_weights_on_model_save",
    ).zero_optimization
    assert z.stage3_gather_16bit_weights_on_model_save is True


def test_seq_parallel_comm_data_type():
    cfg = _parse_warning_once(
        {"seq_parallel_comm_data_type": "bf16"}, "seq_parallel_communication_data_type"
    )
    assert cfg.seq_parallel_communication_data_type == "bf16"


def test_aio_thread_count():
    cfg = _parse_warning_once({"aio": {"thread_count": 4}}, "aio.intra_op_parallelism")
    assert cfg.aio.intra_op_parallelism == 4


def test_zero_short_names_are_silent_aliases():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = parse(
            {"zero_optimization": {"max_live_parameters": 3, "prefetch_bucket_size": 7}}
        ).zero_optimization
    assert z.stage3_max_live_parameters == 3 and z.stage3_prefetch_bucket_size == 7


def test_old_and_new_key_together_is_an_error():
    with pytest.raises(ConfigError, match='"bfloat16" and "bf16" are both given'):
        parse({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="cpu_offload.* and .*offload_optimizer"):
        parse({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_deprecated_key_with_a_wrong_type():
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: expected a boolean"):
        parse({"zero_optimization": {"cpu_offload": "yes"}})


def test_each_alias_warns_once_per_parse():
    cfg = {"bfloat16": {"enabled": True}, "zero_optimization": {"cpu_offload": True}}
    with pytest.warns(DeprecatedConfigKeyWarning) as record:
        parsed = parse(cfg)
    assert len(record) == 2
    with warnings.catch_warnings():  # the stored form is canonical: no repeat later
        warnings.simplefilter("error")
        parsed.with_values({"train_batch_size": 4})


def test_offload_params_is_offload_param():
    z = parse(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_params": {"device": "cpu", "pin_memory": False},
            }
        }
    ).zero_optimization
    assert z.offload_param is not None and z.offload_param.device == "cpu"
    assert z.offload_param.pin_memory is False
    with pytest.raises(ConfigError, match="offload_param"):
        parse({"zero_optimization": {"offload_params": {}, "offload_param": {}}})

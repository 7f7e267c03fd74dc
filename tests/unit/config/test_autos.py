""" "auto" placeholders: listed by path, filled by with_values, and never silently defaulted."""

import pytest

from deepspeed_ext.config import ConfigError, parse

# The shape of the Hugging Face Trainer's documented ZeRO-3 config.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

HF_AUTOS = [
    "fp16.enabled",
    "bf16.enabled",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
]

FILLED = {
    "fp16.enabled": False,
    "bf16.enabled": True,
    "optimizer.params.lr": 3e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 3e-5,
    "scheduler.params.warmup_num_steps": 100,
    "zero_optimization.reduce_bucket_size": 1_048_576,
    "zero_optimization.stage3_prefetch_bucket_size": 943_718,
    "zero_optimization.stage3_param_persistence_threshold": 10_240,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
}


def test_hf_style_config_parses_and_lists_its_autos():
    cfg = parse(HF_ZERO3)
    assert cfg.unresolved_autos() == HF_AUTOS
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.stage3_max_live_parameters == 1_000_000_000
    assert cfg.to_dict()["optimizer"]["params"]["lr"] == "auto"


def test_check_resolved_names_every_auto_and_who_fills_it():
    with pytest.raises(ConfigError) as e:
        parse(HF_ZERO3).check_resolved()
    msg = str(e.value)
    assert all(path in msg for path in HF_AUTOS)
    assert "Hugging Face Trainer" in msg and "set a value" in msg


def test_with_values_fills_and_returns_a_new_config():
    cfg = parse(HF_ZERO3)
    filled = cfg.with_values(FILLED)
    assert filled is not cfg and cfg.unresolved_autos() == HF_AUTOS  # the original is unchanged
    assert filled.unresolved_autos() == []
    filled.check_resolved()
    assert filled.bf16.enabled and not filled.fp16.enabled
    assert filled.optimizer.params["betas"] == (0.9, 0.999)
    assert filled.zero_optimization.reduce_bucket_size == 1_048_576
    assert filled.resolve_batch(2, "test") == (16, 4, 2)
    assert filled.raw == HF_ZERO3


def test_partially_filled_config_still_names_the_rest():
    part = parse(HF_ZERO3).with_values({"fp16.enabled": False, "bf16.enabled": False})
    assert "fp16.enabled" not in part.unresolved_autos()
    with pytest.raises(ConfigError, match="optimizer.params.lr"):
        part.check_resolved()


def test_with_values_validates_what_it_sets():
    with pytest.raises(ConfigError, match="bf16.enabled: expected a boolean"):
        parse(HF_ZERO3).with_values({"bf16.enabled": "yes"})


def test_resolve_batch_refuses_autos():
    with pytest.raises(ConfigError, match='train_batch_size.* still "auto"'):
        parse(HF_ZERO3).resolve_batch(2)


def test_auto_is_a_placeholder_for_any_type_even_a_whole_section():
    cfg = parse({"fp16": "auto", "zero_optimization": {"stage": "auto"}})
    assert cfg.unresolved_autos() == ["fp16", "zero_optimization.stage"]
    filled = cfg.with_values({"fp16.enabled": True, "zero_optimization.stage": 2})
    assert filled.fp16.enabled and filled.zero_optimization.stage == 2


def test_real_auto_values_are_not_placeholders():
    """Where upstream itself takes "auto" (pipeline.stages, ...), it is a value."""
    cfg = parse({"pipeline": {"stages": "auto"}, "data_types": {"keep_in_fp32_modules": "auto"}})
    assert cfg.unresolved_autos() == []
    assert cfg.pipeline.stages == "auto"

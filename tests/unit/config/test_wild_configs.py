"""Configs shaped like the ones in the wild (tutorials, HF examples, Megatron-DeepSpeed) parse."""

import pytest

from deepspeed_ext.config import (
    ConfigError,
    DeprecatedConfigKeyWarning,
    parse,
    validate_config_file,
)

BERT_PRETRAIN = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 64,
    "steps_per_print": 1000,
    "prescale_gradients": False,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 6e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 6e-3,
            "warmup_num_steps": 1000,
            "total_num_steps": 10000,
        },
    },
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
    "zero_allow_untested_optimizer": True,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

MEGATRON = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 1},
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "activation_checkpointing": {
        "partition_activations": True,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
    "flops_profiler": {
        "enabled": False,
        "profile_step": 1,
        "module_depth": -1,
        "top_modules": 3,
        "detailed": True,
    },
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "gpt"},
    "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "gpt"},
    "wandb": {"enabled": False, "project": "gpt"},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
}

ZERO_INFINITY = {
    "train_micro_batch_size_per_gpu": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
            "pipeline_read": False,
            "pipeline_write": False,
        },
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6,
        "sub_group_size": 1e12,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 8,
        "single_submit": False,
        "overlap_events": True,
    },
}

OLD_STYLE = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "cpu_offload": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 5e7,
        "allgather_bucket_size": 5e7,
    },
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
}


@pytest.mark.parametrize(
    "cfg, ws",
    [(BERT_PRETRAIN, 64), (MEGATRON, 8), (ZERO_INFINITY, 4)],
    ids=["bert", "megatron", "zero-infinity"],
)
def test_real_configs_validate(cfg, ws):
    validate_config_file(cfg, ws)


def test_hf_zero2_parses_with_its_autos():
    cfg = parse(HF_ZERO2)
    assert cfg.fp16.auto_cast is False and cfg.zero_optimization.round_robin_gradients is True
    assert cfg.zero_allow_untested_optimizer is True
    assert "fp16.enabled" in cfg.unresolved_autos()


def test_old_style_config_parses_with_deprecation_warnings():
    with pytest.warns(DeprecatedConfigKeyWarning, match="cpu_offload"):
        cfg = validate_config_file(OLD_STYLE, 2)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_force_ds_cpu_optimizer is False


def test_zero_infinity_sizes():
    z = parse(ZERO_INFINITY).zero_optimization
    assert z.sub_group_size == 10**12 and z.stage3_param_persistence_threshold == 10**6
    assert z.offload_param.nvme_path == "/local_nvme" and z.offload_optimizer.device == "nvme"


def test_sections_deepspeed_ext_does_not_run_are_refused_by_name_when_on():
    with pytest.raises(ConfigError) as e:
        parse(
            {
                "train_batch_size": 8,
                "comet": {"enabled": False},
                "amp": {"enabled": True, "opt_level": "O1"},
                "elasticity": {"enabled": False, "max_train_batch_size": 2000},
                "tensor_parallel": {"autotp_size": 2},  # runs (tests/unit/tp)
                "compression_training": {
                    "weight_quantization": {
                        "shared_parameters": {"enabled": True, "quantization_type": "symmetric"},
                        "different_groups": {
                            "wq1": {
                                "params": {"start_bits": 8, "target_bits": 8},
                                "modules": ["attention"],
                            }
                        },
                    }
                },
                "data_efficiency": {
                    "enabled": True,
                    "data_sampling": {
                        "curriculum_learning": {
                            "enabled": True,
                            "curriculum_metrics": {
                                "seqlen": {
                                    "min_difficulty": 8,
                                    "schedule_config": {"difficulty_step": 8},
                                }
                            },
                        }
                    },
                },
                "zero_optimization": {"zenflow": {"topk_ratio": 0.05}},
                "tensorboard": {"enabled": True},
            }
        )
    refused = [p.split(":")[0] for p in e.value.problems]
    assert sorted(refused) == [
        "amp",
        "compression_training",
        "data_efficiency",
        "zero_optimization.zenflow",
    ]
    parse({"comet": {"enabled": False}, "elasticity": {"enabled": False}})  # off: accepted


def test_nested_typo_inside_an_unimplemented_section_is_still_caught():
    metric = {"seqlen": {"min_dificulty": 1}}
    cfg = {
        "data_efficiency": {
            "data_sampling": {"curriculum_learning": {"curriculum_metrics": metric}}
        }
    }
    with pytest.raises(ConfigError) as e:
        parse(cfg)
    path = (
        "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.min_dificulty"
    )
    assert e.value.problems == [f'{path}: unknown key; did you mean "min_difficulty"?']

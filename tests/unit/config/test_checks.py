"""Rules across sections."""

import pytest

from deepspeed_ext.config import ConfigError, parse


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            'zero_optimization.offload_param.nvme_path is required with device "nvme"',
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.nvme_path is required",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "needs stage 3",
        ),
        (
            {"fp16": {"enabled": True, "loss_scale_window": 0}},
            "fp16.loss_scale_window must be > 0 with dynamic loss scaling",
        ),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "needs zero_optimization.stage 1, 2 or 3",
        ),
        (
            {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
            'gradient_allreduce_op "sum" does not work with zero_optimization.stage 3',
        ),
        (
            {"optimizer": {"params": {"lr": 1e-3}}},
            "optimizer.params are given without optimizer.type",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}},
            "optimizer.params.lr is the string '1e-3': give a number",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": ["0.9", 0.99]}}},
            r"optimizer.params.betas is \('0.9', 0.99\): give two numbers",
        ),
        (
            {"optimizer": {"type": "Adafactor"}, "zero_optimization": {"stage": 2}},
            "'Adafactor' factors the second moment .*zero_optimization.stage is 2",
        ),
        (
            {"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}},
            "'Lamb' scales each tensor's update by a trust ratio",
        ),
        (
            {"scheduler": {"type": "warmupLR"}},
            "scheduler.type 'warmupLR': did you mean 'WarmupLR'",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lrr": 1e-3}}},
            "scheduler.params.warmup_max_lrr is not a WarmupLR param: did you mean 'warmup_max_lr'",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "10"}}},
            "scheduler.params.warmup_num_steps is the string '10'.*\n.*needs scheduler.params."
            "total_num_steps",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "scheduler.params.warmup_num_steps must be a positive integer, got 0: give a whole",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "warmup_num_steps": 10.0},
                }
            },
            "scheduler.params.warmup_num_steps must be a positive integer, got 10.0: write 10",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {"total_num_steps": 9, "warmup_num_steps": None},
                }
            },
            "scheduler.params.warmup_num_steps must be a positive integer, got None",
        ),
        (
            {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": -1}}},
            "scheduler.params.lr_range_test_step_size must be a positive integer, got -1",
        ),
        (
            {"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["allreduce"]}},
            "comms_logger.prof_ops: 'allreduce' is not a deepspeed.comm op: did you mean "
            "'all_reduce'",
        ),
        (
            {"flops_profiler": {"enabled": True, "profile_step": -1}},
            "flops_profiler.profile_step is -1",
        ),
        (
            {"flops_profiler": {"enabled": True, "top_modules": 0}},
            "flops_profiler.top_modules is 0",
        ),
        (
            {"jsonl_monitor": {"enabled": True, "output_path": "/tmp", "job_name": ""}},
            "jsonl_monitor.job_name is empty",
        ),
    ],
)
def test_inconsistent_sections(cfg, message):
    with pytest.raises(ConfigError, match=message):
        parse(cfg)


def test_whole_tensor_optimizers_pass_at_stage_0():
    for kind in ("Adafactor", "Lamb", "Muon"):
        assert parse({"optimizer": {"type": kind}}).optimizer.type == kind


def test_consistent_variants_pass():
    parse({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}})  # static scale
    parse({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    parse(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
            }
        }
    )


def test_offload_device_and_stage_are_typed():
    with pytest.raises(ConfigError) as e:
        parse({"zero_optimization": {"stage": 5, "offload_optimizer": {"device": "gpu"}}})
    assert e.value.problems == [
        "zero_optimization.stage: expected one of 0, 1, 2 or 3, got 5 (int)",
        "zero_optimization.offload_optimizer.device: expected one of 'none', 'cpu' or 'nvme', "
        "got 'gpu' (str)",
    ]


def _early(opt_device: str = "nvme", **top) -> dict:
    opt = {"device": opt_device, "nvme_path": "/nvme", "step_in_backward": True}
    return {
        "gradient_clipping": 0.0,
        **top,
        "zero_optimization": {"stage": 3, "offload_optimizer": opt},
    }


@pytest.mark.parametrize(
    "cfg, message",
    [
        (_early(gradient_clipping=1.0), r"gradient_clipping 1.0: .*set gradient_clipping 0"),
        ({**_early(), "gradient_clipping": "auto", "fp16": {"enabled": True}}, "fp16.enabled"),
        (_early(bf16={"enabled": True, "check_grad_overflow": True}), "bf16.check_grad_overflow"),
        (_early("cpu"), r'offload_optimizer.device "cpu": .*set offload_optimizer.device "nvme"'),
    ],
)
def test_step_in_backward_clashes_are_named(cfg, message):
    """[Note: optimizer steps in backward]: an update made during the backward must be the
    one engine.step() would make, so what could change it after the fact is refused."""
    with pytest.raises(ConfigError, match="offload_optimizer.step_in_backward does not work with"):
        parse(cfg)
    with pytest.raises(ConfigError, match=message):
        parse(cfg)


def test_step_in_backward_passes_without_clashes():
    parse(_early())
    parse(_early(bf16={"enabled": True, "check_grad_overflow": False}))


def _late(opt_device: str = "nvme", **opt) -> dict:
    nvme = {"device": opt_device, "nvme_path": "/nvme", "step_in_forward": True, **opt}
    return {"zero_optimization": {"stage": 3, "offload_optimizer": nvme}}


def test_step_in_forward_clashes_are_named():
    """[Note: optimizer steps in forward]: NVMe only, and not with step_in_backward."""
    with pytest.raises(ConfigError, match=r'step_in_forward .*"cpu": set it to "nvme"'):
        parse(_late("cpu"))
    with pytest.raises(ConfigError, match=r"step_in_forward and .*step_in_backward .*keep one"):
        parse({**_late(step_in_backward=True), "gradient_clipping": 0.0})


def test_step_in_forward_takes_clipping_and_fp16():
    """Unlike step_in_backward: engine.step() clips and checks overflow before deferring."""
    parse({**_late(), "gradient_clipping": 1.0, "fp16": {"enabled": True}})


def test_scheduler_check_knows_every_deepspeed_schedule_as_its_constructor_does():
    """The launcher's table of schedule params (no torch there) is the constructors' own."""
    import inspect

    from deepspeed_ext.config.sections.scheduler import SCHEDULE_PARAMS
    from deepspeed_ext.runtime.lr_schedules.factory import SCHEDULES

    assert set(SCHEDULE_PARAMS) == set(SCHEDULES)
    for name, cls in SCHEDULES.items():
        params = list(inspect.signature(cls).parameters.values())[1:]
        required = tuple(p.name for p in params if p.default is p.empty)
        optional = tuple(p.name for p in params if p.default is not p.empty)
        assert SCHEDULE_PARAMS[name] == (required, optional), name


def test_schedules_pass_with_autos_and_torch_types():
    parse({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    parse({"scheduler": {"type": "StepLR", "params": {"step_size": 3}}})  # checked at initialize
    parse({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}})


def test_prof_ops_knows_every_op_the_logger_records():
    from deepspeed_ext.comm.checked import _TENSOR_OPS
    from deepspeed_ext.config.sections.comms_logger import PROF_OPS

    assert _TENSOR_OPS <= PROF_OPS


def test_prof_ops_may_name_either_of_torchs_names():
    from deepspeed_ext.comm.comms_logging import CommsLogger

    log = CommsLogger()
    log.configure(enabled=True, prof_all=False, prof_ops=["reduce_scatter_tensor"])
    assert log.wants("reduce_scatter_single") and not log.wants("all_reduce")

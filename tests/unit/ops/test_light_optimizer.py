"""[Note: optimizers without dynamo]: our optimizers and a whole training job (ZeRO 3, a
checkpoint saved and loaded) never import torch._dynamo (about 70 MB per rank process), and the
optimizer methods work the same once torch._dynamo is loaded."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from deepspeed_ext.ops.adam import FusedAdam

JOB = textwrap.dedent(
    """
    import os, sys, tempfile, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import deepspeed
    from deepspeed_ext.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed_ext.ops.lamb import FusedLamb
    from deepspeed_ext.ops.lion import DeepSpeedCPULion, FusedLion
    for cls in (DeepSpeedCPUAdam, FusedAdam, FusedLamb, DeepSpeedCPULion, FusedLion):
        p = torch.nn.Parameter(torch.randn(5))
        opt = cls([p])
        p.grad = torch.ones(5)
        opt.step()
        opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(d)
        engine.load_checkpoint(d)
    print("DYNAMO", "torch._dynamo" in sys.modules)
    """
)


def test_a_training_job_never_imports_dynamo():
    r = subprocess.run(
        [sys.executable, "-c", JOB], capture_output=True, text=True, timeout=240, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DYNAMO False" in r.stdout, r.stdout[-500:]


def test_methods_work_the_same_once_dynamo_is_loaded():
    import torch._dynamo  # noqa: F401 - the state after a torch.compile somewhere

    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.zero_grad()
    assert p.grad is None
    sd = opt.state_dict()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(opt.param_groups) == 2
    fresh = FusedAdam([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])

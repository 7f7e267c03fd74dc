"""The AVX2 and scalar builds of every CPU op match torch too (the default build covers
the machine's best level in tests/unit/ops)."""

import pytest

from deepspeed_ext.op_builder import cpu_features
from tests.helpers.subproc import run

CHECK = """
import torch
from deepspeed_ext.ops.adam import DeepSpeedCPUAdam
from deepspeed_ext.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed_ext.ops.lion import DeepSpeedCPULion
from deepspeed_ext.op_builder import CPUAdamBuilder
from tests.helpers.optim_parity import parity
from tests.unit.ops.test_cpu_lion import ReferenceLion

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    parity(lambda ps: DeepSpeedCPUAdam(ps, lr=3e-3, weight_decay=0.05),
           lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05, foreach=False), dtype)
    parity(lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2, weight_decay=0.01),
           lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=0.01, foreach=False), dtype)
    parity(lambda ps: DeepSpeedCPULion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
           lambda ps: ReferenceLion(ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), dtype)
print("level", CPUAdamBuilder().load().simd_level())
"""


@pytest.mark.parametrize("level", ["avx2", "scalar"])
def test_level_matches_torch(level, tmp_path):
    if level != "scalar" and not cpu_features._NEEDS[level] <= cpu_features.cpu_flags():
        pytest.skip(f"this CPU has no {level}")
    r = run(CHECK, DS_SIMD=level)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"level {level}" in r.stdout

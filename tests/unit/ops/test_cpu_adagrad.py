"""DeepSpeedCPUAdagrad against torch.optim.Adagrad (see [Note: kernel tolerance])."""

import pytest
import torch

from deepspeed_ext.ops.adagrad import DeepSpeedCPUAdagrad
from tests.helpers.optim_parity import parity, state_dict_roundtrip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_matches_torch_adagrad(dtype, wd):
    parity(
        lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2, eps=1e-10, weight_decay=wd),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2, eps=1e-10, weight_decay=wd, foreach=False),
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip(dtype):
    state_dict_roundtrip(lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2), dtype)


def test_bad_eps():
    with pytest.raises(ValueError, match="eps=-1"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(2))], eps=-1)

"""FusedAdam on CPU tensors (the cpu_adam kernel path) against torch.optim."""

import pytest
import torch

from deepspeed_ext.ops.adam import FusedAdam
from tests.helpers.optim_parity import parity, state_dict_roundtrip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch(dtype, adam_w_mode):
    ref = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    parity(
        lambda ps: FusedAdam(ps, lr=2e-3, weight_decay=0.05, adam_w_mode=adam_w_mode),
        lambda ps: ref(ps, lr=2e-3, weight_decay=0.05, foreach=False),
        dtype,
    )


def test_state_dict_roundtrip():
    state_dict_roundtrip(lambda ps: FusedAdam(ps, lr=1e-3), torch.float32)


def test_amsgrad_and_legacy_step_args_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    p[0].grad = torch.zeros(2)
    with pytest.raises(RuntimeError, match="closure"):
        FusedAdam(p).step(grads=[torch.zeros(2)])

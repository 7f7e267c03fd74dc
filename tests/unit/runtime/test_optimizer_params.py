"""A misspelt optimizer param is named with the constructor's closest name."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.runtime.optimizers import OptimizerConfigError, build_optimizer


@pytest.mark.parametrize(
    ("name", "params", "said"),
    [
        ("AdamW", {"betaz": (0.9, 0.99)}, "'betaz'; did you mean 'betas'?"),
        ("SGD", {"lr": 0.1, "momentun": 0.9}, "'momentun'; did you mean 'momentum'?"),
        ("Lion", {"zzz": 1}, "'zzz'; it takes lr, betas, weight_decay"),
    ],
)
def test_a_misspelt_param_gets_the_closest_name(name, params, said):
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(OptimizerConfigError, match=f"optimizer.params for '{name}'.*{said}"):
        build_optimizer(name, p, params, on_cpu=True)

"""A ZeRO config the optimizer cannot honour fails at initialize, naming the key and the fix."""

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.unit.zero.zero_runs import Net


class Sophia(torch.optim.Optimizer):  # an optimizer ZeRO has never seen
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def _init(kind: str) -> str:
    from deepspeed_ext.runtime.initialize import initialize

    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    opt = None
    if kind == "untested":
        opt = Sophia(model.parameters())
    elif kind == "untested_allowed":
        opt = Sophia(model.parameters())
        cfg["zero_allow_untested_optimizer"] = True
    elif kind == "offload_torch":
        opt = torch.optim.AdamW(model.parameters())
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif kind == "offload_nvme_torch":
        import tempfile

        opt = torch.optim.AdamW(model.parameters())
        nvme = {"device": "nvme", "nvme_path": tempfile.mkdtemp()}
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": nvme}
    elif kind == "lamb":
        cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    try:
        initialize(model=model, optimizer=opt, config=cfg)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize(
    "kind,expect",
    [
        ("untested", "zero_allow_untested_optimizer"),
        ("untested_allowed", "ok"),
        ("offload_torch", "zero_force_ds_cpu_optimizer"),
        ("offload_nvme_torch", "offload_optimizer.device is 'nvme' but the optimizer is AdamW"),
        ("lamb", "trust ratio"),
    ],
)
def test_zero_optimizer_checks(kind, expect):
    (msg,) = run_ranks(_init, 1, kind)
    assert expect in msg, msg

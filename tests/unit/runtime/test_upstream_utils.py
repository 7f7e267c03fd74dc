"""deepspeed.runtime.utils: the helpers upstream code imports from there, against upstream's
documented results (partition_uniform's, and partition_balanced's where both agree)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepspeed.runtime import utils
from deepspeed_ext.accelerator.cuda import CUDAAccelerator


def test_partitions() -> None:
    assert utils.partition_uniform(5, 2) == [0, 3, 5]  # the first parts take the remainder
    assert utils.partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer items than parts
    assert utils.partition_uniform(0, 0) == [0]  # nothing in no parts, as upstream
    assert utils.partition_uniform(0, 3) == [0, 0, 0, 0]
    for bad in ((5, 0), (-1, 2), (3, -1)):
        with pytest.raises(ValueError, match=r"partition_uniform\("):
            utils.partition_uniform(*bad)
    assert utils.partition_balanced([1, 1, 1, 1, 1, 1], 3) == [0, 2, 4, 6]
    assert utils.partition_balanced([1, 1], 4) == [0, 1, 2, 2, 2]
    # the heaviest part as light as it can be: the 8 alone
    assert utils.partition_balanced([1, 1, 8, 1, 1], 3) == [0, 2, 3, 5]


def test_prefix_sum_inc() -> None:
    from deepspeed.runtime.utils import prefix_sum_inc

    weights = [3, 4, 5]
    assert prefix_sum_inc(weights) == [3, 3 + 4, 3 + 4 + 5] and weights == [3, 4, 5]
    assert prefix_sum_inc([]) == []
    assert prefix_sum_inc((0.5, 1.5, 2.0)) == [0.5, 2.0, 4.0]


def test_norms_and_names() -> None:
    assert utils.get_global_norm([3.0, torch.tensor(4.0)]) == 5.0
    assert utils.get_global_norm([1.0, float("nan")]) == math.inf
    assert utils.get_global_norm([1.0, -1.0]) == math.inf  # the overflow marker
    assert utils.is_invalid_grad_norm(torch.tensor([1.0, math.inf]))
    assert utils.call_to_str("ForwardPass", 3, buffer_id="a") == "ForwardPass(3, buffer_id='a')"
    assert utils.call_to_str("OptimizerStep") == "OptimizerStep()"


def test_set_random_seed_seeds_every_generator() -> None:
    import numpy

    draws = []
    for _ in range(2):
        utils.set_random_seed(2**70 + 5)  # larger than numpy and torch take
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]


def test_move_to_device_keeps_structure_and_asks_the_criterion() -> None:
    a, b = torch.ones(2), torch.zeros(2, dtype=torch.long)
    asked: list[torch.Tensor] = []

    def floats(t: torch.Tensor) -> bool:
        asked.append(t)
        return t.is_floating_point()

    out = utils.move_to_device({"x": [a, (b, 3)], "y": "s"}, "cpu", floats)
    assert out["x"][0] is a and out["x"][1][0] is b and out["x"][1][1] == 3 and out["y"] == "s"
    assert isinstance(out["x"][1], tuple) and [t is a or t is b for t in asked] == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDAAccelerator().is_available(), reason="needs a CUDA GPU")
def test_move_to_device_moves_storage_in_place_cuda() -> None:
    a, b = torch.ones(2), torch.zeros(2, dtype=torch.long)
    out = utils.move_to_device([a, b], "cuda", lambda t: t.is_floating_point())
    assert out[0] is a and a.device.type == "cuda"  # every reference sees the move
    assert b.device.type == "cpu"  # refused by the criterion

"""Partitioning layers into stages, and what PipelineModule refuses before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed_ext.runtime.pipe import LayerSpec, PipelineModule
from deepspeed_ext.runtime.pipe.partition import (
    layer_weights,
    partition_balanced,
    partition_layers,
    partition_uniform,
)


def test_uniform() -> None:
    assert partition_uniform(7, 2) == [0, 4, 7]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(5, 5) == [0, 1, 2, 3, 4, 5]


def brute_force_best(weights: list[float], parts: int) -> float:
    import itertools

    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        best = min(best, max(sum(weights[b[i] : b[i + 1]]) for i in range(parts)))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_is_optimal_and_non_empty(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 9, (1,), generator=g))
    parts = int(torch.randint(1, n + 1, (1,), generator=g))
    weights = [float(x) for x in torch.randint(0, 10, (n,), generator=g)]
    b = partition_balanced(weights, parts)
    assert b[0] == 0 and b[-1] == n and all(x < y for x, y in zip(b, b[1:]))
    heaviest = max(sum(weights[b[i] : b[i + 1]]) for i in range(parts))
    assert heaviest == brute_force_best(weights, parts)


def test_parameters_counts_specs_without_building_them() -> None:
    layers = [LayerSpec(nn.Linear, 1000, 1000), torch.relu, LayerSpec(nn.Linear, 10, 10), nn.ReLU()]
    assert layer_weights(layers, "parameters") == [1001000.0, 0.0, 110.0, 0.0]
    assert partition_layers(layers, 2, "parameters") == [0, 1, 4]


def test_type_regex() -> None:
    layers = [nn.Embedding(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)]
    assert layer_weights(layers, "type:linear") == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="matches no layer"):
        layer_weights(layers, "type:Block")


def test_explicit_and_bad_partitions() -> None:
    layers = [nn.ReLU()] * 4
    assert partition_layers(layers, 2, [0, 1, 4]) == [0, 1, 4]
    with pytest.raises(ValueError, match="3 for num_stages=2"):
        partition_layers(layers, 2, [0, 2, 2, 4])
    with pytest.raises(ValueError, match="more than the model's 4 layers"):
        partition_layers(layers, 5, "uniform")
    # model chunks per rank (interleaving, DualPipeV): the message counts what was asked
    with pytest.raises(ValueError, match="5 for 2 stages x 2 model chunks = 4 virtual stages"):
        partition_layers(layers, 4, [0, 1, 2, 4], chunks=2)
    with pytest.raises(ValueError, match="2 stages x 3 model chunks = 6 virtual stages is more"):
        partition_layers(layers, 6, "uniform", chunks=3)
    with pytest.raises(ValueError, match="'profile' is not known"):
        partition_layers(layers, 2, "profile")


def _refusals() -> list[str]:
    out = []
    for layers, kw in [
        ([nn.Linear(2, 2), nn.Linear(2, 2)], {"num_stages": 2}),
        ([nn.Linear(2, 2), nn.Linear(2, 2)], {}),
        ([nn.ReLU(), "relu"], {"num_stages": 1}),
    ]:
        try:
            PipelineModule(layers, **kw)
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def test_module_refuses_bad_stage_counts() -> None:
    from tests.helpers.distributed import run_ranks

    world, missing, bad_layer = run_ranks(_refusals, 1)[0]  # a world of one rank
    assert "does not divide the world size 1" in world
    assert "num_stages=<int> or topology" in missing
    assert "layer 1 is a str" in bad_layer

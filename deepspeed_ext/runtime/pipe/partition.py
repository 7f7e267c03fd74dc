"""Which layers each pipeline stage owns: `parts`, num_stages + 1 boundaries, stage s owning
layers parts[s]..parts[s+1]-1 (upstream's representation).

Methods (upstream's names): "parameters" (balance trainable parameter counts; "best", the
config default, means this), "uniform" (balance layer counts), "type:<regex>" (balance the
layers whose class name matches), or an explicit list of boundaries. Every stage gets at
least one layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed_ext.utils.splits import partition_uniform

from .spec import LayerSpec


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimizing the heaviest part, non-empty while there are at least as
    many items as parts (dynamic programming: layer counts are small). Upstream's minimizes
    the heaviest less the lightest instead, and on ties gives earlier stages the extra
    layers; here the slowest stage, which paces the pipeline, is as light as it can be, and
    ties give the extra layers to later stages, which hold fewer micro-batches' activations
    under 1F1B. So "parameters" and "type:" partitions can differ from upstream's (uniform
    ones do not)."""
    n = len(weights)
    if n <= num_parts:  # one item each, then empty parts (as upstream's)
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the lightest possible heaviest part splitting the first i layers in k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    parts = [n]
    for k in range(num_parts, 0, -1):
        parts.append(cut[k][parts[-1]])
    return parts[::-1]


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _trainable_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without allocating the layer's memory
            module = layer.build()
    elif isinstance(layer, torch.nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_weights(layers: Sequence[Any], method: str) -> list[float]:
    m = method.lower()
    if m in ("parameters", "best"):
        return [float(_trainable_count(layer)) for layer in layers]
    if m == "uniform":
        return [1.0] * len(layers)
    if m.startswith("type:"):
        pattern = re.compile(method[len("type:") :], re.IGNORECASE)
        weights = [1.0 if pattern.search(_type_name(layer)) else 0.0 for layer in layers]
        if not any(weights):
            names = sorted({_type_name(layer) for layer in layers})
            raise ValueError(
                f"partition_method={method!r} matches no layer (layer types: {names}): "
                "give a regex matching the repeated block's class name"
            )
        return weights
    raise ValueError(
        f"partition_method={method!r} is not known: use 'parameters', 'uniform', "
        "'type:<regex>' or a list of num_stages + 1 layer boundaries"
    )


def partition_layers(
    layers: Sequence[Any], num_stages: int, method: Any, chunks: int = 1
) -> list[int]:
    """num_stages parts of the layers; chunks > 1: num_stages counts virtual stages, that
    many model chunks per rank (interleaving, DualPipeV's V), which messages say."""
    n = len(layers)
    ranks = num_stages // chunks
    asked = (
        f"num_stages={num_stages}"
        if chunks == 1
        else f"{ranks} stages x {chunks} model chunks = {num_stages} virtual stages"
    )
    if num_stages > n:
        fix = (
            f"use at most {n} stages"
            if chunks == 1
            else f"use at most {n} virtual stages (fewer stages or model chunks)"
        )
        raise ValueError(
            f"{asked} is more than the model's {n} layers: every pipeline stage needs at "
            f"least one layer; {fix}"
        )
    if isinstance(method, (list, tuple)):
        parts = [int(x) for x in method]
        ok = (
            len(parts) == num_stages + 1
            and parts[0] == 0
            and parts[-1] == n
            and all(a < b for a, b in zip(parts, parts[1:]))
        )
        if not ok:
            raise ValueError(
                f"partition_method={list(method)}: an explicit partition is one more boundary "
                f"than parts, {num_stages + 1} for {asked}, increasing from 0 to {n}, e.g. "
                f"{partition_uniform(n, num_stages)}"
            )
        return parts
    if str(method).lower() == "uniform":
        return partition_uniform(n, num_stages)
    return partition_balanced(layer_weights(layers, str(method)), num_stages)

"""A pipeline's additional losses: upstream's PipelineModule.get_additional_losses() hook.

[Note: additional losses] A PipelineModule whose get_additional_losses() returns
{name: tensor} (MoE auxiliary losses and the like, for reporting) has them read after each
training forward on the last stage and summed over the batch (total_additional_losses); at
the optimizer step they are averaged over the micro-batches and the data-parallel ranks and
reach every stage of the pipeline as agg_additional_losses, scalar ones also on the metrics
line and the monitors. Their count and a key of their names and shapes (sorted by name) ride
on the norm's all-reduce, so only the last stage needs to return them (upstream needs every
stage to return the same names); the values follow in one more all-reduce when there are
any, and the names in a gather when they change. The last stage's data-parallel ranks check,
in the loss's all-reduce, that they all returned the same names and shapes before they sum
the values (a sum of vectors of different lengths would hang or mix them); if not, every rank
raises, naming them.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from deepspeed_ext import comm

Meta = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape), sorted by name
_HOOK = "PipelineModule.get_additional_losses()"


class AdditionalLosses:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics  # StepMetrics: names it must not take, and the values
        self.total: OrderedDict[str, torch.Tensor] | None = None  # the batch's sums (last stage)
        self.agg: OrderedDict[str, torch.Tensor] | None = None  # the batch's means (every rank)
        self._known: tuple[float, Meta] = (0.0, ())  # the key and meta last shared

    def add(self, got: Any) -> None:
        """One training forward's return of the hook, summed into `total`."""
        if got is None:
            return
        if not isinstance(got, Mapping):
            raise TypeError(
                f"{_HOOK} returned a {type(got).__name__}: return a dict of name -> loss "
                "tensor (or number), or None"
            )
        total = self.total
        if total is None:
            total = self.total = OrderedDict()
        for name, value in got.items():
            why = self.metrics.name_clash(name)
            if why is not None:
                raise ValueError(f"{_HOOK}: {why}: rename it")
            t = torch.as_tensor(value).detach().float()
            if name in total and total[name].shape != t.shape:
                raise ValueError(
                    f"{_HOOK}: {name!r} changed shape within a batch "
                    f"({list(total[name].shape)} then {list(t.shape)})"
                )
            total[name] = total[name] + t if name in total else t.clone()

    def batch_means(
        self, losses: list[torch.Tensor], m: int, data: Any, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Meta, bool]:
        """The last stage's batch loss and additional losses, each the mean over the m
        micro-batches and the data-parallel group `data`: loss, this rank's own mean of the
        loss (upstream's dp_group_loss), the rest flat, their meta, and
        whether the data-parallel ranks agree on the meta. The loss's all-reduce carries the
        check (sums of the count and a key, and of their squares: all equal iff
        dp * sum(x^2) == sum(x)^2); the values follow only when there are any, agreed."""
        extra = sorted((self.total or {}).items())
        meta = tuple((name, tuple(t.shape)) for name, t in extra)
        dp = data.size
        loss = torch.stack([v.float() for v in losses]).sum() / m
        n, key = float(sum(t.numel() for _, t in extra)), meta_key(meta, bits=20)
        head = torch.tensor([0.0, n, key, n * n, key * key], dtype=torch.float64).to(device)
        head[0] = loss
        comm.all_reduce(head, group=data)
        total, sn, sk, sn2, sk2 = head.tolist()
        agreed = dp * sn2 == sn * sn and dp * sk2 == sk * sk
        flat = torch.zeros(0, device=device)
        if agreed and n > 0:
            flat = torch.cat([t.reshape(-1) for _, t in extra]).to(device) / m
            comm.all_reduce(flat, group=data)
            flat /= dp
        return torch.tensor(total / dp), loss, flat, meta, agreed

    def share(
        self,
        n: int,
        key: float,
        disagreed: float,
        flat: torch.Tensor | None,
        meta: Meta,
        axis: Any,
        device: torch.device,
    ) -> None:
        """Every rank of the pipeline gets the last stage's means as `agg`: n values and the
        meta's key summed over `axis` (the one counting rank of the last stage holds `flat`
        and `meta`, the rest None)."""
        if disagreed:
            raise ValueError(
                f"{_HOOK}: the last stage's data-parallel ranks returned different names or "
                "shapes this batch; return the same dict keys (and shapes) on every rank, "
                "every micro-batch that returns any"
            )
        if key == 0:  # no names this batch
            self.agg = None
            return
        if key != self._known[0]:  # new names or shapes: learn them
            seen = comm.all_gather_object(meta if flat is not None else None, axis)
            self._known = (key, next(m for m in seen if m is not None))
        values = torch.zeros(n, dtype=torch.float32, device=device)
        if flat is not None:
            values.copy_(flat)
        if n:
            comm.all_reduce(values, group=axis)  # one rank holds them, the rest 0
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        at = 0
        for name, shape in self._known[1]:
            size = math.prod(shape)
            out[name] = values[at : at + size].reshape(shape).clone()
            at += size
        self.agg = out
        scalars = [k for k, v in out.items() if v.numel() == 1]
        if scalars:  # one host read for all of them
            host = torch.stack([out[k].reshape(()) for k in scalars]).tolist()
            self.metrics.add_values(dict(zip(scalars, host)))


def meta_key(meta: Meta, bits: int = 48) -> float:
    """Names and shapes as a number a float64 sum carries exactly (< 2**bits, not 0; 20
    bits where its square is summed too)."""
    if not meta:
        return 0.0
    digest = hashlib.blake2b(repr(meta).encode(), digest_size=8).digest()
    return float((int.from_bytes(digest, "big") >> (64 - bits)) or 1)

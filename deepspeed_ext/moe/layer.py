"""Mixture-of-experts layers with upstream's names: MoE, MOELayer, TopKGate, Experts.

A layer built with ep_size > 1 holds num_experts / ep_size experts on each rank; its groups
are made by deepspeed.initialize (or set_deepspeed_parallelism()) once the process group and
the parallel layout exist ([Note: expert groups]). Routing: [Note: MoE routes].
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_ext.accelerator import get_accelerator
from deepspeed_ext.comm.expert_groups import (
    ExpertGroups,
    all_to_all,
    ensure_expert_groups,
    group_name,
)

from . import gating

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")


class TopKGate(nn.Module):
    """The router: a bias-free fp32 linear map to one logit per expert, then top-k gating."""

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int | float = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ) -> None:
        super().__init__()
        if isinstance(min_capacity, float) and min_capacity.is_integer():
            min_capacity = int(min_capacity)  # 4.0, as configs written for upstream give it
        _check_gate(
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_policy,
            drop_tokens,
        )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = int(min_capacity)  # checked whole above
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.drop_policy = drop_policy
        # set with the layer's groups (ExpertGroups), or a torch process group as code written
        # for upstream gives it
        self.ep_group: Any = ep_group
        # upstream's timing attributes (ms), measured with the engine's wall_clock_breakdown
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: ExpertGroups) -> None:
        self.ep_group = ep_group

    def routes(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> gating.Routes:
        """[s, model_dim] tokens -> their routes ([Note: MoE routes])."""
        x32 = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x32 = gating.multiplicative_jitter(x32, x.device)
        logits = F.linear(x32, self.wg.weight.float())
        if logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"the MoE gate gives {logits.shape[-1]} logits for {self.num_experts} experts: "
                "its weight was changed after the layer was built (sliced by a tensor-parallel "
                "rule?); keep gate.wg whole (each token must see every expert)"
            )
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        agree = gating.agreement(self.ep_group)
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return gating.top1(
                logits,
                factor,
                self.min_capacity,
                used_token,
                noisy,
                self.drop_tokens,
                self.use_rts,
                agree,
            )
        if self.k == 2:
            return gating.top2(
                logits,
                factor,
                self.min_capacity,
                used_token,
                self.drop_tokens,
                self.top2_2nd_expert_sampling and self.training,
                agree,
            )
        return gating.topk(
            logits,
            self.k,
            factor,
            self.min_capacity,
            used_token,
            self.drop_tokens,
            self.drop_policy,
            agree,
        )

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ) -> tuple[Any, ...]:
        """Upstream's returns: (l_aux, combine_weights, dispatch_mask, exp_counts), or with
        sparse_routes (l_aux, capacity, num_experts, experts [k, s] int32 (-1: dropped),
        slots [k, s] int32, weights [k, s], exp_counts). use_tutel changes nothing: routes
        are always dispatched by index ([Note: MoE routes])."""
        clock = _Clock(self.wall_clock_breakdown)
        r = self.routes(input, used_token)
        if sparse_routes:
            out: tuple[Any, ...] = (
                r.l_aux,
                r.capacity,
                r.num_experts,
                r.experts.to(torch.int32),
                r.slots.to(torch.int32),
                r.weights,
                r.exp_counts,
            )
        else:
            out = gating.dense_form(r)
        if clock.on:
            self.gate_time = clock.total()
        return out


class Experts(nn.Module):
    """This rank's experts: copies of one module, each applied to its own token buffer. Their
    params carry upstream's marks (allreduce False, group_name): [Note: expert groups]."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """[ranks, local experts, capacity, m] -> the same shape, each expert on its slice."""
        outs = []
        for chunk, e in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = e(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, all-to-all to the experts' ranks, experts, all-to-all back, combine."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: ExpertGroups | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.num_experts = ep_size * num_local_experts
        # upstream's timing attributes (ms), measured with the engine's wall_clock_breakdown
        self.wall_clock_breakdown = False
        self.time_moe = self.time_falltoall = self.time_salltoall = 0.0
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        # Tutel's gain (dispatch by index, not by one-hot einsum) is how this layer always
        # dispatches ([Note: MoE routes]), so use_tutel asks for nothing more
        self.use_tutel = use_tutel

    def _set_ep_group(self, ep_group: ExpertGroups) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        groups = self.ep_group
        if self.ep_size > 1 and groups is None:
            raise RuntimeError(
                f"this MoE layer has ep_size {self.ep_size} but no expert groups: pass the "
                "model to deepspeed.initialize first (or call set_deepspeed_parallelism() on "
                "the MoE layer once torch.distributed is initialized)"
            )
        clock = _Clock(self.wall_clock_breakdown)
        m = x.shape[-1]
        tokens = x.reshape(-1, m)
        routes = self.gate.routes(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        buf = gating.dispatch(tokens, routes)  # [e, c, m], e in global expert order
        if groups is not None:
            with clock.lap() as first:
                buf = all_to_all(buf, groups.expert)  # now [sender ranks x local experts, c, m]
        out = self.experts(buf.reshape(self.ep_size, self.num_local_experts, -1, m))
        out = out.reshape(self.ep_size * self.num_local_experts, -1, m)
        if groups is not None:
            with clock.lap() as second:
                out = all_to_all(out, groups.expert)  # back home: [global experts, c, m]
        result = gating.combine(out, routes).reshape(x.shape)
        if clock.on:
            self.time_moe = clock.total()
            if groups is not None:
                self.time_falltoall, self.time_salltoall = first.ms, second.ms
        return result


class MoE(nn.Module):
    """Upstream's MoE layer: forward(hidden_states, used_token=None) returns
    (output, l_aux, exp_counts). use_residual makes it a residual MoE (PR-MoE): the output
    mixes the experts' with a dense copy of the expert by a learned, softmaxed coefficient."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int | float = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE ep_size={ep_size!r} must be a positive int dividing num_experts="
                f"{num_experts}: each rank of the expert-parallel group holds as many experts"
            )
        if enable_expert_tensor_parallelism:
            raise ValueError(
                "MoE enable_expert_tensor_parallelism=True: slicing experts over the tensor-"
                "parallel group is not built yet; remove it (experts stay whole on each rank)"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate,
            experts,
            self.expert_group_name,
            ep_size,
            self.num_local_experts,
            use_tutel=use_tutel,
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make (or find) this layer's expert groups under the current layout. Collective."""
        if self.ep_size > 1:
            groups = ensure_expert_groups(self.ep_size, use_data_before_expert_parallel_)
            self.deepspeed_moe._set_ep_group(groups)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        moe = self.deepspeed_moe
        assert moe.l_aux is not None and moe.exp_counts is not None
        return output, moe.l_aux, moe.exp_counts


class _Lap:
    ms = 0.0


class _Clock:
    """Wall-clock laps in ms when on (upstream's MoE timing attributes), the device
    synchronized at each mark so queued kernels count; free when off."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.start = self._now() if on else 0.0

    @staticmethod
    def _now() -> float:
        get_accelerator().synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def lap(self) -> Iterator[_Lap]:
        lap = _Lap()
        t = self._now() if self.on else 0.0
        yield lap
        if self.on:
            lap.ms = (self._now() - t) * 1000.0

    def total(self) -> float:
        return (self._now() - self.start) * 1000.0


def _check_gate(
    num_experts: int,
    k: int,
    capacity_factor: float,
    eval_capacity_factor: float,
    min_capacity: int | float,
    noisy_gate_policy: str | None,
    drop_policy: str,
    drop_tokens: bool = True,
) -> None:
    def bad(name: str, value: Any, fix: str) -> ValueError:
        return ValueError(f"MoE {name}={value!r}: {fix}")

    if not isinstance(num_experts, int) or num_experts < 1:
        raise bad("num_experts", num_experts, "give a positive number of experts")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise bad("k", k, f"each token picks k of the {num_experts} experts: 1 <= k <= num_experts")
    for name, v in (
        ("capacity_factor", capacity_factor),
        ("eval_capacity_factor", eval_capacity_factor),
    ):
        # 0 is upstream's way to a fixed capacity of min_capacity
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise bad(name, v, "give a factor >= 0 (1.0: an even share of the tokens)")
    if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
        raise bad("min_capacity", min_capacity, "give a count >= 0")
    if drop_tokens and min_capacity == 0 and 0 in (capacity_factor, eval_capacity_factor):
        raise bad(
            "min_capacity",
            min_capacity,
            "with a capacity factor of 0 every expert's capacity is 0 and every token is "
            "dropped; give min_capacity >= 1 (a fixed capacity) or a factor above 0",
        )
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise bad("noisy_gate_policy", noisy_gate_policy, "use None, 'Jitter' or 'RSample'")
    if noisy_gate_policy == "RSample" and k != 1:
        raise bad(
            "noisy_gate_policy",
            noisy_gate_policy,
            f"RSample samples the first choice of top-1 gating only (k={k}); with k=2 the "
            "second expert is sampled by top2_2nd_expert_sampling. Use 'Jitter' or None",
        )
    if drop_policy not in DROP_POLICIES:
        raise bad("drop_policy", drop_policy, "use 'probs' or 'position'")

"""The MoE layer in one process against a token-by-token reference written from GShard's and
upstream's documented rules: top-1 / top-2 / top-k choice, capacity (first come, or most
confident), normalised top-2 / top-k weights, used_token, the residual mix, the auxiliary
loss; gradients by autograd through both; upstream's dense gating outputs; bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from deepspeed_ext.moe import MoE, top1gating, top2gating, topkgating
from deepspeed_ext.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

H, E = 6, 4
EPS = torch.finfo(torch.float32).eps


def _layer(k: int, **kw) -> MoE:
    torch.manual_seed(0)
    kw = {"drop_tokens": False, "use_rts": False, "top2_2nd_expert_sampling": False, **kw}
    moe = MoE(H, nn.Linear(H, H), num_experts=E, k=k, **kw)
    with torch.no_grad():  # experts start as copies: make them differ
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape))
    return moe


def _reference(moe: MoE, x: torch.Tensor, k: int, cap: int | None, policy: str = "position"):
    """Token by token. Top-2 queues every first choice before any second (GShard); top-k
    (k > 2) queues by token; 'probs' keeps each expert's highest gates."""
    gate = moe.deepspeed_moe.gate
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    t = x.reshape(-1, H)
    gates = torch.softmax(t.float() @ gate.wg.weight.float().T, dim=1)
    top = torch.topk(gates, k, dim=1).indices.tolist()
    kept: list[set[int]] = [set() for _ in range(len(t))]
    if cap is None:
        kept = [set(c) for c in top]
    elif policy == "probs":
        for e in range(E):
            chosen = [s for s in range(len(t)) if e in top[s]]
            for s in sorted(chosen, key=lambda s: -float(gates[s, e].detach()))[:cap]:
                kept[s].add(e)
    else:
        load = [0] * E
        order = (
            [(s, top[s][j]) for j in range(k) for s in range(len(t))]
            if k == 2
            else [(s, e) for s in range(len(t)) for e in top[s]]
        )
        for s, e in order:
            if load[e] < cap:
                kept[s].add(e)
            load[e] += 1
    out = []
    for s in range(len(t)):
        row = torch.zeros(H)
        kept_gates = torch.stack([gates[s, e] for e in kept[s]]) if kept[s] else torch.zeros(1)
        denom = 1.0 if k == 1 else torch.clamp(kept_gates.sum(), min=EPS)
        for e in kept[s]:
            row = row + gates[s, e] / denom * experts[e](t[s])
        out.append(row)
    return torch.stack(out).reshape(x.shape), gates, top


CASES = [
    (1, {}, None, "position"),
    (1, {"drop_tokens": True, "min_capacity": 0}, 1.0, "position"),
    (2, {}, None, "position"),
    (2, {"drop_tokens": True, "min_capacity": 0, "capacity_factor": 0.5}, 0.5 * 2, "position"),
    (3, {}, None, "position"),
    (3, {"drop_tokens": True, "min_capacity": 0, "capacity_factor": 0.5}, 0.5 * 3, "probs"),
]


@pytest.mark.parametrize(("k", "kw", "factor", "policy"), CASES)
def test_output_and_gradients_match_the_token_by_token_reference(k, kw, factor, policy):
    moe = _layer(k, **kw)
    x = torch.randn(2, 10, H, requires_grad=True)
    cap = None if factor is None else math.ceil(20 / E * factor)
    y, l_aux, counts = moe(x)
    ref, gates, top = _reference(moe, x, k, cap, policy)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    want_counts = torch.zeros(E, dtype=torch.int64)
    for c in top:
        for e in c:
            want_counts[e] += 1
    assert counts.tolist() == want_counts.tolist()  # choices before capacity, as upstream
    (gy,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
    (gr,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gy, gr, rtol=1e-4, atol=1e-6)
    me = gates.mean(0)
    first = torch.nn.functional.one_hot(torch.tensor([c[0] for c in top]), E).float().mean(0)
    if k == 1:
        want = (me * first).sum() * E
    elif k == 2:
        want = (me * first).mean() * E * E
    else:
        ce = (want_counts.float() / len(top)).to(me.dtype)
        want = (me * ce).mean() * E * E / k
    torch.testing.assert_close(l_aux, want)


def test_gate_and_experts_get_the_reference_gradients():
    moe = _layer(2, drop_tokens=True, min_capacity=0, capacity_factor=0.5)
    x = torch.randn(16, H)
    ref_moe = _layer(2, drop_tokens=True, min_capacity=0, capacity_factor=0.5)
    y, _, _ = moe(x)
    y.square().sum().backward()
    ref, _, _ = _reference(ref_moe, x, 2, math.ceil(16 / E * 0.5 * 2))
    ref.square().sum().backward()
    for (n, a), b in zip(moe.named_parameters(), ref_moe.parameters()):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=n)


def test_random_token_selection_keeps_chosen_tokens_up_to_capacity():
    moe = _layer(1, drop_tokens=True, use_rts=True, min_capacity=0, capacity_factor=0.5)
    x = torch.randn(40, H)
    routes = moe.deepspeed_moe.gate.routes(x)
    cap = math.ceil(40 / E * 0.5)
    assert routes.capacity == cap
    gates = torch.softmax(x @ moe.deepspeed_moe.gate.wg.weight.T, 1)
    choice = gates.argmax(1)
    for e in range(E):
        kept = routes.experts[0] == e
        n_chosen = int((choice == e).sum())
        assert int(kept.sum()) == min(n_chosen, cap)
        assert bool((choice[kept] == e).all())
        assert sorted(routes.slots[0][kept].tolist()) == list(range(int(kept.sum())))


def test_used_token_masks_tokens_out():
    moe = _layer(1)
    x = torch.randn(8, H)
    used = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    y, _, counts = moe(x, used)
    assert y[used == 0].abs().max() == 0
    full, _, _ = moe(x)
    torch.testing.assert_close(y[used == 1], full[used == 1])
    assert int(counts.sum()) == 6


def test_eval_uses_the_eval_capacity_factor():
    moe = _layer(
        1, drop_tokens=True, min_capacity=0, capacity_factor=0.25, eval_capacity_factor=2.0
    )
    x = torch.randn(16, H)
    assert moe.deepspeed_moe.gate.routes(x).capacity == 1
    moe.eval()
    assert moe.deepspeed_moe.gate.routes(x).capacity == 8


def test_residual_moe_mixes_the_dense_expert_by_its_coefficient():
    moe = _layer(1, use_residual=True)
    x = torch.randn(5, H)
    y, _, _ = moe(x)
    experts_only = moe.deepspeed_moe(x)
    coef = torch.softmax(moe.coefficient(x), -1)
    torch.testing.assert_close(y, experts_only * coef[:, :1] + moe.mlp(x) * coef[:, 1:])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_upstream_dense_gating_outputs_are_consistent(k: int):
    logits = torch.randn(12, E)
    if k == 1:
        l_aux, cw, mask, counts = top1gating(logits, 1.0, 2, use_rts=False)
        per_token = 1
    elif k == 2:
        l_aux, cw, mask, counts = top2gating(logits, 1.0, 2, top2_2nd_expert_sampling=False)
        per_token = 2
    else:
        l_aux, cw, mask, counts = topkgating(logits, 3, 1.0, 2)
        per_token = 3
    s, e, c = cw.shape
    assert (s, e) == (12, E) and c == max(math.ceil(12 / E * per_token), 2)
    assert torch.equal(mask, cw > 0)
    assert int(counts.sum()) == 12 * per_token
    assert bool((mask.sum((0, 2)) <= c).all())  # no expert over capacity
    assert bool((mask.sum(0) <= 1).all())  # one token per slot
    gates = torch.softmax(logits, 1)
    kept = cw.sum(2)
    if k == 1:  # top-1 weights are the raw gates
        torch.testing.assert_close(kept[kept > 0], gates[kept > 0])
    else:  # normalised over the kept routes
        full = kept.sum(1) > 0
        torch.testing.assert_close(kept.sum(1)[full], torch.ones(int(full.sum())))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"k": 0}, "k=0"),
        ({"k": 5}, "k=5"),
        ({"ep_size": 3}, "ep_size=3"),
        ({"noisy_gate_policy": "gumbel"}, "noisy_gate_policy='gumbel'"),
        ({"noisy_gate_policy": "RSample", "k": 2}, "top2_2nd_expert_sampling"),
        ({"capacity_factor": -1.0}, "capacity_factor=-1.0"),
        ({"min_capacity": 2.5}, "min_capacity=2.5"),
        ({"capacity_factor": 0.0, "min_capacity": 0}, "every token is dropped"),
        ({"enable_expert_tensor_parallelism": True}, "enable_expert_tensor_parallelism"),
    ],
)
def test_bad_arguments_are_named(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        MoE(H, nn.Linear(H, H), num_experts=E, **kw)


def test_spread_layer_without_groups_says_how_to_get_them():
    moe = MoE(H, nn.Linear(H, H), num_experts=E, ep_size=2)
    with pytest.raises(RuntimeError, match="deepspeed.initialize"):
        moe(torch.randn(4, H))


def test_optimizer_groups_keep_experts_apart():
    moe = _layer(1)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(moe.parameters()), "name": "all", "lr": 0.1}]
    )
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == "ep_size_1" and groups[1]["lr"] == 0.1
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    assert all(is_moe_param(p) for p in groups[1]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(moe.parameters()))


def test_upstream_import_paths():
    import deepspeed
    from deepspeed.moe.layer import MoE as FaceMoE
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate
    from deepspeed.utils import groups

    assert FaceMoE is MoE
    assert deepspeed.moe.experts.Experts is not None and MOELayer and TopKGate
    assert callable(groups._get_expert_parallel_group)
    assert groups._get_max_expert_size() >= 1


def test_a_zero_capacity_factor_is_a_fixed_capacity_and_float_counts_are_taken():
    moe = _layer(1, drop_tokens=True, capacity_factor=0.0, min_capacity=3.0)
    assert moe.deepspeed_moe.gate.routes(torch.randn(40, H)).capacity == 3


def test_sparse_routes_are_upstreams_index_form_of_the_same_routing():
    gate = _layer(2, drop_tokens=True, min_capacity=0).deepspeed_moe.gate
    x = torch.randn(12, H)
    l_aux, cw, mask, counts = gate(x)
    l2, cap, e, experts, slots, weights, counts2 = gate(x, None, True)
    assert (cap, e) == (cw.shape[2], E) and experts.dtype == slots.dtype == torch.int32
    assert torch.equal(l_aux, l2) and torch.equal(counts, counts2)
    dense = torch.zeros_like(cw)
    for r in range(2):
        for s in range(12):
            if experts[r, s] >= 0:
                dense[s, experts[r, s], slots[r, s]] += weights[r, s]
    torch.testing.assert_close(dense, cw)


def test_timing_attributes_are_measured_when_asked():
    moe = _layer(1)
    layer = moe.deepspeed_moe
    assert layer.time_moe == 0.0 and layer.gate.gate_time == 0.0
    layer.wall_clock_breakdown = layer.gate.wall_clock_breakdown = True
    layer.gate(torch.randn(4, H))
    moe(torch.randn(4, H))
    assert layer.time_moe > 0.0 and layer.gate.gate_time > 0.0


def test_configure_moe_param_groups_leaves_split_groups_alone():
    from deepspeed_ext.moe.utils import configure_moe_param_groups

    moe = _layer(1)
    once = configure_moe_param_groups(list(moe.parameters()))
    twice = configure_moe_param_groups(once)
    assert [(g.get("moe", False), len(g["params"])) for g in twice] == [
        (g.get("moe", False), len(g["params"])) for g in once
    ]


def test_expert_rank_lists_are_upstreams():
    """Upstream's documented E + M + D example (16 ranks, tensor 2, ep 4), and D + E."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    ep, edp = _get_expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    ep, edp = _get_expert_parallel_ranks(8, 1, 2, use_data_before_expert_parallel_=True)
    assert ep == [[0, 4], [1, 5], [2, 6], [3, 7]] and edp == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_gate_cut_to_fewer_experts_is_named():
    """A tensor-parallel rule slicing gate.wg would route each rank over part of the experts."""
    moe = _layer(2)
    gate = moe.deepspeed_moe.gate
    gate.wg = nn.Linear(H, E // 2, bias=False)
    with pytest.raises(ValueError, match="gives 2 logits for 4 experts"):
        moe(torch.randn(4, H))

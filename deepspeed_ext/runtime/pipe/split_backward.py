"""A stage's backward split in two (zero-bubble schedules): the input-gradient pass B, which
the previous stage waits for, and the weight-gradient pass W, which can run later to fill
the pipeline's idle time.

[Note: split backward] The stage's autograd graph is cut where each parameter's gradient
path joins the path to the stage inputs. B runs autograd to the inputs only (no weight
gradient is computed: autograd skips edges that lead to no requested input) and captures,
with node pre-hooks, the gradients flowing into those join nodes. W then runs, per group
of parameters sharing join nodes, autograd from the join nodes with the captured gradients
to the parameters alone, so no activation gradient is computed twice and the parameters'
gradients accumulate (and their hooks fire) as in a plain backward. A graph that cannot be
cut this way (a parameter used again further along the input path, reentrant activation
checkpointing, an output that is a leaf) runs its whole backward in B; W is then empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# reentrant checkpointing runs its own backward inside, which cannot be asked for part of
# the gradients: torch's, and deepspeed.checkpointing's (pipeline.use_reentrant)
_UNSPLITTABLE = ("CheckpointFunctionBackward", "_ReentrantBackward")


class WeightGradPass:
    """W of one micro-batch: accumulates the parameters' gradients."""

    def __init__(self, groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[Any]]]):
        self._groups = groups

    def run(self) -> None:
        groups, self._groups = self._groups, []
        for edges, grads, params in groups:
            if edges:  # no gradient reached this group's joins: its weights get none
                # the join nodes' graph is shared between groups: keep it until the last
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)


def _graph(roots: list[Node], inputs: set[Node]) -> tuple[dict[Node, list[Node]], set[Node]]:
    """Parents of every node reachable from the roots, and the nodes that lead to an input
    (the inputs' ancestors)."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    stack = list(parents)
    while stack:  # iterative: a deep stage graph must not hit the recursion limit
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    leads = {n for n in inputs if n in parents}
    stack = list(leads)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in leads:
                leads.add(parent)
                stack.append(parent)
    return parents, leads


def _reaches(start: Node, targets: set[Node]) -> bool:
    if not targets:
        return False
    stack = [c for c, _ in start.next_functions if c is not None]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None)
    return False


class SplitPlan:
    """One micro-batch's backward, cut: input_pass() now, weight_pass() later."""

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
        groups: list[tuple[set[Node], list[Node]]],
        leads: set[Node],
        param_nodes: dict[Node, torch.Tensor],
    ) -> None:
        self._outputs, self._grads, self._inputs = list(outputs), list(grads), list(inputs)
        self._groups, self._leads, self._param_nodes = groups, leads, param_nodes
        self._weights: WeightGradPass | None = None

    def input_pass(self) -> tuple[torch.Tensor | None, ...]:
        """B: the inputs' gradients (None for an input no output depends on)."""
        captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        handles = []
        for node in {j for joins, _ in self._groups for j in joins if j in self._leads}:

            def keep(grad_outputs: tuple[Any, ...], node: Node = node) -> None:
                captured[node] = tuple(grad_outputs)

            handles.append(node.register_prehook(keep))
        try:
            in_grads: tuple[torch.Tensor | None, ...] = tuple(None for _ in self._inputs)
            if self._inputs and any(o.grad_fn in self._leads for o in self._outputs):
                in_grads = torch.autograd.grad(
                    self._outputs,
                    self._inputs,
                    grad_outputs=self._grads,
                    retain_graph=True,
                    allow_unused=True,
                )
        finally:
            for h in handles:
                h.remove()
        self._weights = WeightGradPass(
            [self._weight_group(joins, pnodes, captured) for joins, pnodes in self._groups]
        )
        self._outputs, self._inputs = [], []  # W holds the graph through its join nodes
        return tuple(in_grads)

    def weight_pass(self) -> None:
        """W: accumulate the parameters' gradients (after input_pass)."""
        assert self._weights is not None, "weight_pass() runs once, after input_pass()"
        self._weights.run()
        self._weights = None

    def _weight_group(
        self,
        joins: set[Node],
        pnodes: list[Node],
        captured: dict[Node, tuple[torch.Tensor | None, ...]],
    ) -> tuple[list[GradientEdge], list[torch.Tensor], list[Any]]:
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for node in joins:
            if node in captured:
                for i, g in enumerate(captured[node]):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        seeds.append(g)
                continue
            # an output node B never ran: seeded with the gradient given for its output
            for out, g in zip(self._outputs, self._grads):
                if out.grad_fn is node:
                    edges.append(GradientEdge(node, out.output_nr))
                    seeds.append(g if g is not None else torch.ones_like(out))
        return edges, seeds, [self._param_nodes[n] for n in pnodes]


def plan_split(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> SplitPlan | str:
    """Cut the backward from `outputs` (with `grads`) for `inputs` (leaves that need a
    gradient) and `params`; or why the graph cannot be cut ([Note: split backward])."""
    roots = [o.grad_fn for o in outputs]
    if any(r is None for r in roots):
        return "an output is a leaf tensor (no autograd graph to cut)"
    root_nodes: list[Node] = [r for r in roots if r is not None]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    parents, leads = _graph(root_nodes, input_nodes)
    for n in parents:
        if type(n).__name__ in _UNSPLITTABLE:
            return (
                f"the graph holds {type(n).__name__} (reentrant activation checkpointing); "
                "use_reentrant=False checkpointing can be split"
            )
    # each parameter's join nodes: the first nodes on its paths to the outputs that lead to
    # an input, and the output nodes on the way
    root_set = set(root_nodes)
    param_nodes = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    joins_of: dict[Node, set[Node]] = {}
    for pnode in param_nodes:
        if pnode not in parents:
            continue  # not used in this micro-batch
        joins: set[Node] = set()
        stack, seen = list(parents[pnode]), set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in leads:
                joins.add(node)
                continue
            if node in root_set:  # seeded with its output's gradient, and what flows in
                joins.add(node)
            stack.extend(parents[node])
        joins_of[pnode] = joins
    groups = _group(joins_of)
    for joins, _ in groups:
        # a join that B completed must not get more flow in W (it would count twice)
        if len(joins) > 1 and any(_reaches(j, (joins & leads) - {j}) for j in joins):
            names = sorted(type(n).__name__ for n in joins)
            return f"a weight is used again further along the input path (at {names})"
    return SplitPlan(outputs, grads, inputs, groups, leads, param_nodes)


def _group(joins_of: dict[Node, set[Node]]) -> list[tuple[set[Node], list[Node]]]:
    """Parameters that share a join node go in one W call (with the union of their joins)."""
    groups: list[tuple[set[Node], list[Node]]] = []
    for pnode, joins in joins_of.items():
        merged_joins, merged_params = set(joins), [pnode]
        rest = []
        for gj, gp in groups:
            if gj & merged_joins:
                merged_joins |= gj
                merged_params = gp + merged_params
            else:
                rest.append((gj, gp))
        groups = [*rest, (merged_joins, merged_params)]
    return groups

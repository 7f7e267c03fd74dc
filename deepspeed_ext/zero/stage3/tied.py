"""Per-use leaf aliases of parameters that several modules own.

[Note: per-use aliases of tied parameters]
A parameter owned by several modules (tied embeddings: the input embedding and the output
head) gets a gradient from each use, and autograd sums the uses in the parameter's own
accumulation buffer: the head's full-size gradient is held from the head's backward, at the
start of backward, to the embedding's, at its end. Under stage 3 each use runs instead on a
leaf alias of the gathered value (a new Parameter on the same storage, so gathers and
releases reach it), and each alias's gradient is reduce-scattered into the parameter's
partition as soon as that use's backward has made it. Partitions add, so the result is the
same sum; the cost is one more reduce-scatter of the tied parameter per extra use.
Not aliased: under torch.compile (a new leaf every step would recompile), with grad off, in
an activation checkpoint's recompute (the original forward's alias is the graph's leaf), and
parameters inside a z3 leaf module (its children have no hooks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .param import is_zero_param


def shared_param_ids(modules: list[torch.nn.Module]) -> set[int]:
    """ids of the parameters that more than one of `modules` owns directly."""
    owners: Counter[int] = Counter()
    for m in modules:
        for p in {id(p): p for p in m._parameters.values() if p is not None}.values():
            owners[id(p)] += 1
    return {i for i, n in owners.items() if n > 1}


def tied_names(modules: list[torch.nn.Module]) -> dict[int, list[str]]:
    """id(module) -> names of its own trainable partitioned parameters that another of
    `modules` also owns."""
    shared = shared_param_ids(modules)
    out: dict[int, list[str]] = {}
    for m in modules:
        names = [
            n
            for n, p in m._parameters.items()
            if p is not None and p.requires_grad and is_zero_param(p) and id(p) in shared
        ]
        if names:
            out[id(m)] = names
    return out


class TiedAliases:
    """Swaps a module's tied parameters for fresh aliases around each of its forwards."""

    def __init__(self, names: dict[int, list[str]], on_grad: Callable[[Any, Any], None]):
        self.names = names
        self.on_grad = on_grad  # (parameter, alias): the alias holds one use's gradient
        self.stacks: dict[int, list[list[tuple[str, Any]] | None]] = {}
        self.uses = 0  # aliases made

    def wants(self, module: torch.nn.Module) -> bool:
        return id(module) in self.names

    def swap_in(self, module: torch.nn.Module, alias: bool) -> None:
        """Call once per forward of a module that wants() it, after its gather; every call
        is matched by one restore()."""
        stack = self.stacks.setdefault(id(module), [])
        if not (alias and torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            stack.append(None)
            return
        swapped = []
        for n in self.names[id(module)]:
            p = module._parameters[n]
            if p is None:  # unset since the hooks went in
                continue
            a = torch.nn.Parameter(p.data, requires_grad=True)
            a.register_post_accumulate_grad_hook(lambda a, p=p: self.on_grad(p, a))
            module._parameters[n] = a
            swapped.append((n, p))
            self.uses += 1
        stack.append(swapped)

    def restore(self, module: torch.nn.Module, *_: Any) -> None:
        stack = self.stacks.get(id(module))
        swapped = stack.pop() if stack else None
        for n, p in swapped or ():
            module._parameters[n] = p

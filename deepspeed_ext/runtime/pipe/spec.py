"""LayerSpec and TiedLayerSpec: layers described, built only on the stage that owns them.

A spec holds a layer's class and constructor arguments, so a model too big for one process
is never built whole: each stage builds its own slice (upstream's deepspeed.pipe API).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LayerSpec:
    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, torch.nn.Module):
            raise TypeError(
                f"LayerSpec(typename={typename!r}): typename must be a torch.nn.Module subclass "
                "(pass the class, e.g. LayerSpec(torch.nn.Linear, 16, 16))"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (`tied_weight_attr`) are shared by every layer with the same
    `key`, on whichever stages they fall; `forward_fn(module, inputs)` lets one tied module
    act differently per use (an embedding used again as the output projection)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )

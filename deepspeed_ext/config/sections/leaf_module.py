"""`zero_optimization.leaf_module`: modules ZeRO-3 fetches whole instead of hooking inside."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from ..types import Section, Str


def _one_or_many(v: Any) -> Any:
    return [v] if isinstance(v, str) else v  # upstream accepts a single string


Names = Annotated[tuple[Str, ...], BeforeValidator(_one_or_many)]


class LeafModuleConfig(Section):
    classes: Names = (
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    )
    names: Names = ()
    name_suffixes: Names = ()

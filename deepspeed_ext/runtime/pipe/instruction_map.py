"""Upstream's PipelineEngine._INSTRUCTION_MAP (instruction type -> handler), read-only here:
this engine's handlers take the instruction itself, not upstream's keyword arguments, so a
patch written for upstream's engine (Megatron-DeepSpeed's --enable-zbh1-pipeline replaces its
backward handlers) cannot run; it is refused by name instead of failing on a missing name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

_REFUSAL = (
    "PipelineEngine._INSTRUCTION_MAP cannot be changed here: this engine's instruction "
    "handlers take the instruction object, not upstream's keyword arguments, so handlers "
    "written for upstream's engine cannot run. The zero-bubble schedule that Megatron-"
    'DeepSpeed patches in is built in: set "pipeline": {"schedule": "zb-h1"}'
)


class InstructionMap(Mapping[type, str]):
    """Instruction type -> the name of the engine method that runs it."""

    def __init__(self, names: dict[type, str]) -> None:
        self._names = dict(names)

    def __getitem__(self, kind: type) -> str:
        return self._names[kind]

    def __iter__(self) -> Iterator[type]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __setitem__(self, kind: type, handler: Any) -> NoReturn:
        raise TypeError(_REFUSAL)

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_REFUSAL)

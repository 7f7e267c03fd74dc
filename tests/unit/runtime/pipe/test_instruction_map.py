"""Upstream's PipelineEngine._INSTRUCTION_MAP: readable (every instruction this engine runs,
to the method that runs it) and refused by name when code written for upstream's engine
patches it (Megatron-DeepSpeed's --enable-zbh1-pipeline), pointing at the built-in zb-h1."""

from __future__ import annotations

import pytest

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine


def test_the_map_names_a_method_for_every_instruction() -> None:
    mapped = PipelineEngine._INSTRUCTION_MAP
    kinds = [
        getattr(schedule, n)
        for n in dir(schedule)
        if isinstance(getattr(schedule, n), type)
        and issubclass(getattr(schedule, n), schedule.PipeInstruction)
        and getattr(schedule, n).__module__ == schedule.PipeInstruction.__module__
    ]
    concrete = [k for k in kinds if not any(issubclass(o, k) and o is not k for o in kinds)]
    assert set(concrete) <= set(mapped), sorted(k.__name__ for k in set(concrete) - set(mapped))
    for kind, name in mapped.items():
        assert callable(getattr(PipelineEngine, name)), (kind, name)


@pytest.mark.parametrize("patch", ["update", "setitem"])
def test_patching_it_is_refused_by_name(patch: str) -> None:
    def handler(self: object, buffer_id: int) -> None:
        pass

    with pytest.raises(TypeError, match='"schedule": "zb-h1"'):
        if patch == "update":
            PipelineEngine._INSTRUCTION_MAP.update({schedule.BackwardPass: handler})
        else:
            PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass] = handler  # type: ignore[index]
    assert PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass] == "_exec_backward_pass"

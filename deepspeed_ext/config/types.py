"""Field types shared by the section models, and the Section base class.

JSON configs are checked strictly: a boolean must be true/false (not "yes" or 1), an integer
may be written 5e8 (JSON's float spelling of a whole number, common in DeepSpeed configs) but
not 2.5 or "8". Wrong types raise PydanticCustomError("expected", ...) so the parser can say
"<key path>: expected <what>, got <value>".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, PlainValidator
from pydantic_core import PydanticCustomError


def _expected(what: str) -> PydanticCustomError:
    return PydanticCustomError("expected", "expected {expected}", {"expected": what})


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _expected("a boolean (true or false)")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _expected("an integer")
    if isinstance(v, float):
        if not v.is_integer():  # also rejects inf and nan
            raise _expected("an integer")
        return int(v)
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _expected("a number")
    if not math.isfinite(v):
        raise _expected("a finite number")
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _expected("a string")
    return v


Bool = Annotated[bool, BeforeValidator(_bool)]
Int = Annotated[int, BeforeValidator(_int)]
Float = Annotated[float, BeforeValidator(_float)]
Str = Annotated[str, BeforeValidator(_str)]

# For fields where upstream itself accepts the string "auto" as a real value (pipeline.stages,
# zenflow intervals, ...). Only fields whose type contains this literal keep "auto"; anywhere
# else "auto" is a placeholder an integration must fill (see schema.scan).
AUTO = "auto"
Auto = Literal["auto"]


def _lower(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


def _upper(v: Any) -> Any:
    return v.upper() if isinstance(v, str) else v


# Validators to put in Annotated[Literal[...], ...]: upstream lowercases or uppercases some
# names before comparing, and writes whole numbers as floats (3.0, 5e8).
ToLower = BeforeValidator(_lower)
ToUpper = BeforeValidator(_upper)
Whole = BeforeValidator(_int)


# Upstream's DtypeEnum spellings, normalised to one short name so consumers compare one string.
_DTYPE_SPELLINGS = {
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "int8": ("int8", "torch.int8"),
}
_DTYPE_OF = {s: name for name, spellings in _DTYPE_SPELLINGS.items() for s in spellings}


def _dtype(v: Any) -> Any:
    return _DTYPE_OF.get(v.lower(), v) if isinstance(v, str) else v


DtypeName = Annotated[Literal["fp16", "fp32", "bf16", "int8"], BeforeValidator(_dtype)]
FloatDtypeName = Annotated[Literal["fp16", "fp32", "bf16"], BeforeValidator(_dtype)]


class FrozenMap(Mapping[str, Any]):
    """A read-only dict. Copying returns the same object (nothing in it can change), so section
    defaults holding one can be shared."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __copy__(self) -> FrozenMap:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenMap:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))


def freeze(v: Any) -> Any:
    """Read-only deep copy of JSON-like data: dicts become FrozenMaps, lists tuples."""
    if isinstance(v, Mapping):
        return FrozenMap({k: freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def thaw(v: Any) -> Any:
    """The plain dict/list form of frozen data (for to_dict and JSON)."""
    if isinstance(v, Mapping):
        return {k: thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [thaw(x) for x in v]
    return v


def _mapping(v: Any) -> Any:
    if not isinstance(v, Mapping):
        raise _expected("an object ({...})")
    return freeze(v)


# Free-form pass-through dicts (optimizer.params, ...): any keys, values kept read-only.
FreeDict = Annotated[
    Mapping[str, Any], PlainValidator(_mapping), PlainSerializer(thaw, return_type=dict)
]
EMPTY: Mapping[str, Any] = FrozenMap()


class Section(BaseModel):
    """One config section: frozen, and unknown keys are rejected (the parser finds them first
    so it can name the full path and suggest a key)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    def active(self) -> bool:
        """Whether the user turned this section on (most sections have an `enabled` flag)."""
        return bool(getattr(self, "enabled", False))

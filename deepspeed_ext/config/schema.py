"""Walk a raw config alongside the section models: find unknown keys and "auto" placeholders.

This runs before pydantic so an unknown key can be named by its full path with a suggestion,
and so "auto" can stand in for a value of any type until an integration fills it.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel

from .types import AUTO


@dataclass
class Scan:
    known: dict[str, Any]  # the input minus unknown keys ("auto" placeholders kept)
    unknown: list[tuple[str, str | None]] = field(default_factory=list)  # (path, suggestion)
    autos: list[str] = field(default_factory=list)  # paths of "auto" placeholders


def join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _members(tp: Any) -> list[Any]:
    """The alternatives of a type, through Annotated, Optional and unions."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _members(typing.get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [m for arg in typing.get_args(tp) for m in _members(arg)]
    return [tp]


def _section_of(tp: Any) -> type[BaseModel] | None:
    for m in _members(tp):
        if isinstance(m, type) and issubclass(m, BaseModel):
            return m
    return None


def _mapping_value(tp: Any) -> Any:
    """For dict[str, V] / Mapping[str, V] fields: V (Any for free-form dicts), else None."""
    for m in _members(tp):
        if typing.get_origin(m) in (dict, Mapping):
            args = typing.get_args(m)
            return args[1] if len(args) == 2 else Any
    return None


def admits_auto(tp: Any) -> bool:
    """Whether "auto" is a real value of this type (a Literal["auto"] member)."""
    return any(typing.get_origin(m) is Literal and AUTO in typing.get_args(m) for m in _members(tp))


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def suggest(key: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def scan(model: type[BaseModel], data: Mapping[str, Any], path: str = "") -> Scan:
    out = Scan(known={})
    _walk(model, data, path, out.known, out)
    return out


def _walk(
    model: type[BaseModel], data: Mapping[str, Any], path: str, dest: dict[str, Any], out: Scan
) -> None:
    fields = model.model_fields
    for key, value in data.items():
        here = join(path, key)
        info = fields.get(key)
        if info is None:
            out.unknown.append((here, suggest(str(key), list(fields))))
            continue
        tp = info.annotation
        if _is_auto(value) and not admits_auto(tp):
            out.autos.append(here)
            dest[key] = value
            continue
        sub = _section_of(tp)
        elem = _mapping_value(tp)
        if sub is not None and isinstance(value, Mapping):
            dest[key] = {}
            _walk(sub, value, here, dest[key], out)
        elif elem is not None and isinstance(value, Mapping):
            dest[key] = _walk_mapping(elem, value, here, out)
        else:
            dest[key] = value


def _walk_mapping(elem: Any, data: Mapping[str, Any], path: str, out: Scan) -> dict[str, Any]:
    """A dict field: user-named entries of a section type, or free-form values."""
    sub = _section_of(elem)
    result: dict[str, Any] = {}
    for key, value in data.items():
        here = join(path, key)
        if _is_auto(value) and not admits_auto(elem):
            out.autos.append(here)
            result[key] = value
        elif sub is not None and isinstance(value, Mapping):
            result[key] = {}
            _walk(sub, value, here, result[key], out)
        elif sub is None and isinstance(value, Mapping):
            result[key] = _walk_mapping(Any, value, here, out)  # nested free-form dict
        else:
            result[key] = value
    return result


# -- dotted paths ------------------------------------------------------------------------------


def get_path(data: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path; KeyError when any part is missing."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set a dotted path, creating objects on the way (an "auto" placeholder object too)."""
    *parents, last = path.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def without_paths(data: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    """A deep copy of `data` with the given dotted paths removed."""
    result = copy.deepcopy(dict(data))
    for path in paths:
        *parents, last = path.split(".")
        node: Any = result
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return result

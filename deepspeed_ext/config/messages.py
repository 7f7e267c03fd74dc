"""pydantic's validation errors as one line each: "<key path>: expected <what>, got <value>"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from .schema import join

# pydantic error type -> what was expected, for the types the section models use.
_EXPECTED = {
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "dict_type": "an object ({...})",
    "model_type": "an object ({...})",
    "model_attributes_type": "an object ({...})",
    "mapping_type": "an object ({...})",
    "list_type": "a list",
    "tuple_type": "a list",
    "none_required": "null",
}
_BOUNDS = {
    "greater_than": "a value greater than {gt}",
    "greater_than_equal": "a value of at least {ge}",
    "less_than": "a value less than {lt}",
    "less_than_equal": "a value of at most {le}",
}


def _expected(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "expected":
        return str(ctx["expected"])
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    if kind in _BOUNDS:
        return _BOUNDS[kind].format(**ctx)
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    return str(err["msg"]).removeprefix("Value error, ")


def _path(loc: Sequence[Any], data: Any) -> str:
    """The key path of an error location: its leading parts that are keys of the input (the
    rest are pydantic's union-member tags such as 'int' or "literal['auto']")."""
    path, node = "", data
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            break
        path = f"{path}[{part}]" if isinstance(part, int) else join(path, part)
    return path


def problems(error: ValidationError, data: Mapping[str, Any]) -> list[str]:
    """One message per key path; a union's failed alternatives are merged with "or"."""
    by_path: dict[str, tuple[Any, list[str]]] = {}
    for err in error.errors():
        path = _path(err["loc"], data) or "<config>"
        value, wanted = by_path.setdefault(path, (err.get("input"), []))
        if _expected(err) not in wanted:
            wanted.append(_expected(err))
    return [
        f"{path}: expected {' or '.join(wanted)}, got {_show(value)}"
        for path, (value, wanted) in by_path.items()
    ]


def _show(value: Any) -> str:
    """A value as JSON readers know it, with its type: 'yes' (str), true, null."""
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"

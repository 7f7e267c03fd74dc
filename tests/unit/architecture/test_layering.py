"""The layer table of docs/architecture.md, enforced by walking every import with ast.

Imports point down only; back-edges only under `if TYPE_CHECKING:`. torch.distributed only
in comm/; torch.cuda and .cuda() only in accelerator/. op_builder imports no third-party
module at import time (torch lazily inside functions); utils is stdlib only.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]

# source folder -> installed package
MAPPED = {
    "op_builder": "deepspeed_ext.op_builder",
    "accelerator": "deepspeed_ext.accelerator",
    "ops": "deepspeed_ext.ops",
    "deepspeed_ext": "deepspeed_ext",
    "deepspeed": "deepspeed",
}

P = "deepspeed_ext."
ALLOWED: dict[str, set[str]] = {
    "deepspeed_ext.version": set(),
    "deepspeed_ext.utils": set(),
    "deepspeed_ext.op_builder": set(),
    "deepspeed_ext.accelerator": {P + "op_builder"},
    "deepspeed_ext.ops": {P + "accelerator", P + "op_builder"},
    "deepspeed_ext.config": {P + "utils"},
    "deepspeed_ext.comm": {P + "accelerator", P + "utils"},
    "deepspeed_ext.monitor": {P + "accelerator", P + "utils"},
    "deepspeed_ext.zero": {P + x for x in ("comm", "ops", "config", "accelerator", "utils")},
    "deepspeed_ext.tp": {P + x for x in ("comm", "ops", "config", "accelerator", "utils")},
    "deepspeed_ext.moe": {P + x for x in ("comm", "accelerator", "utils")},
    "deepspeed_ext.runtime": {
        P + x
        for x in ("zero", "tp", "moe", "comm", "ops", "config", "monitor", "accelerator", "utils")
    },
    "deepspeed_ext.launcher": {P + "config", P + "utils"},
    "deepspeed_ext.env_report": {"*"},
    "deepspeed": {"*"},
}
NO_THIRD_PARTY = {"deepspeed_ext.utils", "deepspeed_ext.version"}
LAZY_TORCH_ONLY = {"deepspeed_ext.op_builder"}  # third-party imports only inside functions


def unit_of(module: str) -> str | None:
    """The table row a module belongs to (longest matching prefix)."""
    best = None
    for key in ALLOWED:
        if (module == key or module.startswith(key + ".")) and (
            best is None or len(key) > len(best)
        ):
            best = key
    return best


def source_files() -> Iterator[tuple[Path, str]]:
    for folder, pkg in MAPPED.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield f, ".".join([pkg, *parts])


def imports(tree: ast.Module, module: str, is_pkg: bool) -> Iterator[tuple[str, int, bool, bool]]:
    """(imported module, line, under TYPE_CHECKING, inside a function)."""

    def walk(node: ast.AST, tc: bool, fn: bool) -> Iterator[tuple[str, int, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            c_tc = tc
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                c_tc = True
            c_fn = fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, child.lineno, c_tc, c_fn
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                yield target, child.lineno, c_tc, c_fn
                for a in child.names:  # `from pkg import submodule`
                    yield f"{target}.{a.name}", child.lineno, c_tc, c_fn
            yield from walk(child, c_tc, c_fn)

    yield from walk(tree, False, False)


def first_party(name: str) -> bool:
    return name == "deepspeed_ext" or name.startswith(("deepspeed_ext.", "deepspeed."))


def test_every_module_has_a_layer():
    missing = [m for _, m in source_files() if unit_of(m) is None and m != "deepspeed_ext"]
    assert not missing, f"modules outside the layer table (add them to ALLOWED): {missing}"


def test_imports_point_down_only():
    bad = []
    for path, module in source_files():
        unit = unit_of(module) or module
        tree = ast.parse(path.read_text())
        for target, line, tc, in_fn in imports(tree, module, path.name == "__init__.py"):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            top = target.split(".")[0]
            if first_party(target):
                tu = unit_of(target)
                if tu is None or tu == unit or tc:
                    continue
                if module == "deepspeed_ext" and tu == "deepspeed_ext.version":
                    continue
                allowed = ALLOWED[unit]
                if "*" not in allowed and tu not in allowed and tu != "deepspeed_ext.version":
                    bad.append(f"{where}: layer {unit} may not import {tu}")
            elif top in sys.stdlib_module_names or top == "__future__":
                continue
            elif unit in NO_THIRD_PARTY:
                bad.append(f"{where}: {unit} is stdlib-only")
            elif unit in LAZY_TORCH_ONLY and not in_fn:
                bad.append(f"{where}: {unit} may import third-party modules only inside functions")
    assert not bad, "\n".join(bad)


def test_torch_distributed_only_in_comm_and_cuda_only_in_accelerator():
    bad = []
    for path, module in source_files():
        src = path.read_text()
        tree = ast.parse(src)
        unit = unit_of(module) or module
        for node in ast.walk(tree):
            text = None
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                text = ast.unparse(node)
            elif isinstance(node, ast.Attribute):
                text = ast.unparse(node)
            if not text:
                continue
            if "torch.distributed" in text and unit != "deepspeed_ext.comm":
                bad.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: torch.distributed outside comm/"
                )
            if unit != "deepspeed_ext.accelerator" and (
                "torch.cuda" in text
                or (
                    isinstance(node, ast.Attribute)
                    and node.attr == "cuda"
                    and not text.startswith("torch.version")
                )
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text} outside accelerator/")
    assert not bad, "\n".join(sorted(set(bad)))


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for folder, pkg in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    missing = found - listed
    assert not missing, f"packages missing from pyproject [tool.setuptools].packages: {missing}"


def test_collectives_go_through_the_checked_door():
    """Inside comm/, only checked.py (every collective, so device-strict mode sees it) and
    init.py (bringing the process group up and down) import torch.distributed."""
    allowed = {"checked.py", "init.py"}
    bad = []
    for path in sorted((ROOT / "deepspeed_ext" / "comm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and path.name not in allowed:
                if "torch.distributed" in ast.unparse(node):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "import torch.distributed in comm/ outside checked.py: " + ", ".join(bad)

"""The package's layering: every import of one wwrun module by another, at module
level or inside a function, runs one way (the CLI -> launcher -> scale -> runner ->
config at the bottom), so that no module needs another half-initialised."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wwrun"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _module_of(name: str) -> str | None:
    """The wwrun module an imported name lives in: `wwrun.scale.plan` -> wwrun.scale."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def imports_of(module: str) -> set[str]:
    """The wwrun modules `module` imports, anywhere in its source. (A submodule's
    parent package runs first, as Python does it, and is not counted.)"""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {_module_of(name) for name in names if name.split(".")[0] == "wwrun"}
    return found - {None, module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for child in sorted(graph.get(node, ())):
            cycle = visit(child)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle():
    graph = {module: imports_of(module) for module in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_config_is_at_the_bottom():
    assert imports_of("wwrun.config") == set()


def test_the_run_is_below_the_launcher_and_scale_out():
    below_the_run = {"wwrun.runner", *_reachable("wwrun.runner")}
    assert not {"wwrun.launcher", "wwrun.scale", "wwrun.scale.driver", "wwrun.scale.engines"} & below_the_run
    assert "wwrun.runner" in _reachable("wwrun.scale.engines")
    assert "wwrun.runner" in _reachable("wwrun.launcher")


def _reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for child in imports_of(todo.pop()) - seen:
            seen.add(child)
            todo.append(child)
    return seen


@pytest.mark.parametrize("module", ["wwrun.runner", "wwrun.scale.driver", "wwrun.scale.engines", "wwrun.cli"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    # Imported first, a module of a cycle finds its partner half-initialised.
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr

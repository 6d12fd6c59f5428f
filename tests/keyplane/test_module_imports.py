"""The package's import graph: no module imports ``keyplane.testing`` but tests, and the
orchestration steps import each other one way only.

Read from the source with ``ast`` (function-level imports included), so a lazy
import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "include" / "keyplane"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names (``from a import b`` gives ``a`` and
    ``a.b``, since ``b`` may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def test_production_code_does_not_import_the_test_helpers() -> None:
    graph = _graph()
    importers = sorted(name for name, imported in graph.items() if "keyplane.testing" in imported)
    assert importers == [], importers


def test_the_orchestration_steps_do_not_import_each_other_in_a_cycle() -> None:
    graph = _graph()
    steps = sorted(
        name
        for name in graph
        if name.startswith("keyplane.orchestration.")
        and (name.endswith("_steps") or name.endswith("run_records"))
    )
    assert "keyplane.orchestration.rollout_steps" in graph["keyplane.orchestration.scale_steps"]
    assert len(steps) == 7, steps

    def reaches(start: str, seen: set[str]) -> set[str]:
        for imported in graph[start] & set(steps):
            if imported not in seen:
                seen.add(imported)
                reaches(imported, seen)
        return seen

    cycles = [name for name in steps if name in reaches(name, set())]
    assert cycles == [], cycles


def test_the_cli_commands_do_not_import_the_entry_point() -> None:
    """``keyplane.cli`` imports every command module (through its parser); a command module
    that imported it back would find it half-initialised, depending on which is imported first."""
    graph = _graph()
    commands = sorted(name for name in graph if name.startswith("keyplane.cli."))
    assert "keyplane.cli.rollout" in commands
    importers = [
        name
        for name in commands
        if name != "keyplane.cli.__main__" and "keyplane.cli" in graph[name]
    ]
    assert importers == [], importers

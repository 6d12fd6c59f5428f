"""The generated reference pages cover the code they describe.

The CLI and configuration pages are generated at build time
(``scripts/docs_reference.py``); these tests check the generator: every
subcommand gets a section with its own help, and every setting a row with a
meaning, so an undescribed new setting fails here rather than reaching the
docs as a blank cell.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from keyplane.cli.parser import build_parser
from keyplane.kafka.security import KafkaSecurity
from keyplane.settings import Settings

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "docs_reference", REPO / "scripts" / "docs_reference.py"
)
assert _spec is not None and _spec.loader is not None
docs_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_reference)


def _leaf_commands(parser: argparse.ArgumentParser, prefix: str = "keyplane") -> list[str]:
    """Every full command line that takes no further subcommand."""
    children = [
        (name, child)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, child in action.choices.items()
    ]
    if not children:
        return [prefix]
    return [cmd for name, child in children for cmd in _leaf_commands(child, f"{prefix} {name}")]


def test_every_subcommand_has_a_section_with_its_usage() -> None:
    page = docs_reference.cli_reference()
    commands = _leaf_commands(build_parser())

    assert "keyplane job start" in commands and "keyplane generate pairs" in commands
    for command in commands:
        assert f"# `{command}`\n" in page, command
        assert f"usage: {command} " in page, command


def test_every_setting_has_a_row_with_a_meaning() -> None:
    page = docs_reference.settings_reference()

    for model in (Settings, KafkaSecurity):
        rows = list(docs_reference.settings_rows(model))
        assert len(rows) == len(model.model_fields)
        for variable, _kind, _default, meaning in rows:
            assert variable.startswith("KEYPLANE_")
            assert meaning, f"{variable} has no description: give its Field one"
            assert f"| `{variable}` |" in page


def test_the_markers_are_replaced_and_other_pages_left_alone() -> None:
    page = f"# CLI\n\n{docs_reference.CLI_MARKER}\n"

    assert docs_reference.CLI_MARKER not in docs_reference.on_page_markdown(page)
    assert "usage: keyplane" in docs_reference.on_page_markdown(page)
    assert docs_reference.on_page_markdown("# Other\n") == "# Other\n"

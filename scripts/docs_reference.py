"""The CLI and configuration reference pages, generated from the code they describe.

`mkdocs build` calls :func:`on_page_markdown` (a hook named in ``mkdocs.yml``): it
replaces the markers ``<!-- cli-reference -->`` and ``<!-- settings-reference -->``
with the help of every ``keyplane`` subcommand, as argparse prints it, and a table of
every ``KEYPLANE_*`` variable read from the pydantic settings models. Generated, not
written, so that a new subcommand or setting is in the docs the day it is in the code.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from collections.abc import Iterator
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

CLI_MARKER = "<!-- cli-reference -->"
SETTINGS_MARKER = "<!-- settings-reference -->"

HELP_WIDTH = "100"
"""Columns argparse wraps help to: fixed, so that the page does not depend on the
terminal that built it."""

UNDESCRIBED = {
    "KEYPLANE_BROKER_PORT": "Port of the embedded broker on the loopback interface.",
    "KEYPLANE_EVENTS_TOPIC": "The routed job's input topic.",
    "KEYPLANE_RESULTS_TOPIC": "Where the reference job writes its counts.",
    "KEYPLANE_SPARK_MASTER": "Spark master of the jobs keyplane starts.",
    "KEYPLANE_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, "
    "for every keyplane Kafka client and the JVM connector.",
    "KEYPLANE_KAFKA_SASL_MECHANISM": "SASL mechanism, with a SASL_* protocol only.",
    "KEYPLANE_KAFKA_SASL_USERNAME": "SASL username, with a SASL_* protocol only.",
}
"""Meanings of the settings whose field has no ``description`` of its own."""


def subcommands(
    parser: argparse.ArgumentParser, prefix: str = "keyplane"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command line ``parser`` accepts, depth first: ``("keyplane broker", …)``."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from subcommands(child, f"{prefix} {name}")


def cli_reference() -> str:
    """Markdown: a section per command line, with its ``--help`` in a code block."""
    with warnings.catch_warnings():
        # kafka-python's protocol tables use a deprecated importlib call on import.
        warnings.simplefilter("ignore", DeprecationWarning)
        from keyplane.cli.parser import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        sections = []
        for command, parser in subcommands(build_parser()):
            depth = command.count(" ")
            heading = "#" * min(2 + depth, 4)
            sections.append(f"{heading} `{command}`\n\n```text\n{parser.format_help()}```\n")
        return "\n".join(sections)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None or field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    return f"`{field.default}`" if field.default != "" else "empty"


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it: ``'memory' or 's3'``, ``Path or unset``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " or ".join(f"'{arg}'" for arg in args)
    if origin is Annotated:
        return _type(args[0])
    if origin in (Union, UnionType):
        kinds = [_type(arg) for arg in args if arg is not type(None)]
        return " or ".join(kinds) + (" or unset" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def settings_rows(model: type[BaseSettings]) -> Iterator[tuple[str, str, str, str]]:
    """``(variable, type, default, meaning)`` for every field of a settings model."""
    prefix = str(model.model_config.get("env_prefix", ""))
    for name, field in model.model_fields.items():
        variable = f"{prefix}{name}".upper()
        meaning = field.description or UNDESCRIBED.get(variable, "")
        yield variable, _type(field.annotation), _default(field), meaning


def settings_reference() -> str:
    """Markdown: one table per settings model, one row per ``KEYPLANE_*`` variable."""
    from keyplane.kafka.security import KafkaSecurity
    from keyplane.settings import Settings

    tables = []
    for model in (Settings, KafkaSecurity):
        lines = [
            f"### `{model.__module__}.{model.__name__}`",
            "",
            (model.__doc__ or "").strip().split("\n\n")[0],
            "",
            "| variable | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for variable, kind, default, meaning in settings_rows(model):
            cell = meaning.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{variable}` | {kind} | {default} | {cell} |")
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def on_page_markdown(markdown: str, **_: object) -> str:
    """mkdocs hook: fill in the generated references where a page asks for them."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_reference())
    return markdown


_SPHINX_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|data|meth|attr|exc|obj):(?=<code)")
"""A Sphinx role before inline code (``:func:`x```): the docstrings cite code the
way Sphinx reads it, and mkdocstrings renders the role's name as text."""


def on_page_content(html: str, **_: object) -> str:
    """mkdocs hook: the API page shows ``:func:`x``` as ``x``, as Sphinx would."""
    return _SPHINX_ROLE.sub("", html)

"""Stage names come from the pipeline, not from literals: no library module spells the
reference pipeline's stages ``"A"`` and ``"B"`` but its own definition.

Code that implements the reference pipeline's fixed shape imports
:data:`~keyplane.reference.pipeline.FIRST_STAGE` and ``SECOND_STAGE``; code
that follows the configured pipeline reads its stage names. Read from the
source with ``ast``, so a literal in a function, a default or an f-string
counts, and a docstring that merely mentions stage A does not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE, counts
from keyplane.spark.jvm import SOURCES as JAVA_SOURCES

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [ROOT / "include", ROOT / "dags", ROOT / "plugins", ROOT / "spark_jobs"]
REFERENCE = ROOT / "include" / "keyplane" / "reference"
"""The reference pipeline's own package, where its stage names are defined."""
STAGE_LITERALS = {"A", "B"}


def _stage_literals(path: Path) -> list[str]:
    """``path:line`` of each string constant ``"A"`` or ``"B"`` in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in STAGE_LITERALS
    ]


def test_no_library_module_outside_the_reference_pipeline_names_a_stage_a_or_b() -> None:
    modules = [
        path
        for folder in LIBRARY
        for path in sorted(folder.rglob("*.py"))
        if not path.is_relative_to(REFERENCE)
    ]
    assert len(modules) > 100  # the whole package was read, not an empty glob
    found = [where for path in modules for where in _stage_literals(path)]
    assert found == [], (
        "name the reference pipeline's stages with keyplane.reference.pipeline.FIRST_STAGE / "
        f"SECOND_STAGE, or follow the pipeline's stage_names: {found}"
    )


def test_the_scan_finds_the_literals_where_the_reference_pipeline_defines_them() -> None:
    """The one place the literals live is found by the same scan, so the scan can fail."""
    assert len(_stage_literals(REFERENCE / "pipeline.py")) == 2


def test_the_stage_constants_are_the_reference_pipelines_stages_in_chain_order() -> None:
    assert counts().stage_names == (FIRST_STAGE, SECOND_STAGE)


def test_the_jvm_stages_name_the_reference_stages_once_as_the_pipeline_does() -> None:
    """The JVM stages cannot import the Python constants: they declare their own, once, and
    these must agree, with no other ``"A"`` or ``"B"`` in the Java sources."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in JAVA_SOURCES)
    declared = dict(re.findall(r'static final String (FIRST_STAGE|SECOND_STAGE) = "(\w*)";', text))
    assert declared == {"FIRST_STAGE": FIRST_STAGE, "SECOND_STAGE": SECOND_STAGE}
    assert len(re.findall(r'"[AB]"', text)) == 2

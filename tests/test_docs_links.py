"""Every relative link in the README and docs/ names a file that exists, and every
``#anchor`` a heading of that file, as GitHub renders it.

The docs cite each other by section (benchmarks.md's goals table, live-routing.md's
hand-off), and sections move as they grow; a broken link is found here, not by a reader.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "docs_reference", REPO / "scripts" / "docs_reference.py"
)
assert _spec is not None and _spec.loader is not None
docs_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_reference)
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, where a link is a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors_of(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated one gets ``-1``, ``-2``, … as on GitHub.

    Cached: a document links to the same few files many times.
    """
    seen: Counter[str] = Counter()
    anchors = set()
    # The reference pages' headings are generated at build time, as mkdocs does.
    for line in _prose_lines(docs_reference.on_page_markdown(path.read_text())):
        match = _HEADING.match(line)
        if match:
            anchor = heading_anchor(match.group(1))
            anchors.add(anchor if seen[anchor] == 0 else f"{anchor}-{seen[anchor]}")
            seen[anchor] += 1
    return anchors


def relative_links(path: Path) -> list[str]:
    links = [m.group(1) for line in _prose_lines(path.read_text()) for m in _LINK.finditer(line)]
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]


def test_heading_anchors_follow_githubs_rule() -> None:
    assert (
        heading_anchor("A live reconfiguration that moves 10k keys (paper 000 §3.4)")
        == "a-live-reconfiguration-that-moves-10k-keys-paper-000-34"
    )
    assert heading_anchor("The `keyplane_scale` DAG") == "the-keyplane_scale-dag"


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    """``doc``'s relative links that name no file, or no heading of the file they name."""
    broken = []
    for link in relative_links(doc):
        target, _, anchor = link.partition("#")
        file = (doc.parent / target).resolve() if target else doc
        if not file.exists():
            broken.append(f"{link}: no file {file.relative_to(root)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors_of(file):
            broken.append(f"{link}: no heading with that anchor in {file.relative_to(root)}")
    return broken


def test_a_missing_file_or_heading_is_reported_and_code_blocks_are_not_read(
    tmp_path: Path,
) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A section (§1)\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#a-section-1), [self](#doc), [web](https://example.org)\n"
        "[gone](missing.md) and [no heading](other.md#no-such-section)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )

    assert broken_links(doc, tmp_path) == [
        "missing.md: no file missing.md",
        "other.md#no-such-section: no heading with that anchor in other.md",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_an_existing_file_and_heading(doc: Path) -> None:
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(REPO)}:\n" + "\n".join(broken)

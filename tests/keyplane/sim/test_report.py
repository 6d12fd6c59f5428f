import pytest

from keyplane.sim.report import format_cell, markdown_table


def test_markdown_table_formats_cells() -> None:
    table = markdown_table(["policy", "locality", "n"], [["hash", 0.16666, 6], ["x", None, 1]])
    assert table.splitlines() == [
        "| policy | locality | n |",
        "|---|---|---|",
        "| hash | 0.167 | 6 |",
        "| x | – | 1 |",
    ]


def test_format_cell_special_values() -> None:
    assert format_cell(float("nan")) == "n/a"
    assert format_cell(float("inf")) == "∞"
    assert format_cell(1234.5678, digits=5) == "1234.6"


def test_row_width_is_checked() -> None:
    with pytest.raises(ValueError, match="row 0"):
        markdown_table(["a", "b"], [[1]])

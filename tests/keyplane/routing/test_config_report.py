"""``keyplane config show|diff`` on a real store written by ``config.save``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from keyplane.cli import main
from keyplane.routing.config import OperatorRouting, RoutingConfig, save
from keyplane.routing.config_report import render_config, render_diff
from keyplane.settings import Settings

CREATED = datetime(2026, 11, 3, 12, 30, tzinfo=UTC)

V1 = RoutingConfig(
    version=1,
    created_at=CREATED,
    created_by="initial",
    operators={
        "by_region": OperatorRouting(
            parallelism=4,
            table={"Asia": 0, "Europe": 3, "Africa": 1},
            hot_keys={"America": (1, 2, 3)},
        ),
        "by_hashtag": OperatorRouting(
            parallelism=3, table={"#rust": 0, "#scala": 1}, hot_keys={"#java": (0, 1)}
        ),
    },
)

# Against V1: Asia moves 0 → 2, America merges onto 1, Africa splits over
# [1, 0], Oceania leaves its hash instance 1 for 0; #java widens to 3
# instances, #rust falls back to hashing (instance 2), and #scala falls back
# to hashing too but lands on the instance it already had (1), so it stays.
V2 = RoutingConfig(
    version=2,
    parent_version=1,
    created_at=CREATED,
    created_by="schedule",
    operators={
        "by_region": OperatorRouting(
            parallelism=4,
            table={"Asia": 2, "Europe": 3, "America": 1, "Oceania": 0},
            hot_keys={"Africa": (1, 0)},
        ),
        "by_hashtag": OperatorRouting(parallelism=3, hot_keys={"#java": (0, 1, 2)}),
    },
)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    directory = tmp_path / "configs"
    save(V1, directory)
    save(V2, directory)
    return directory


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run a failing command; return its single stderr line after checking the exit code."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_show_defaults_to_the_latest_version(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == [
        "version 2",
        "parent: 1",
        "created by schedule at 2026-11-03T12:30:00+00:00",
    ]


def test_show_a_version(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checksum = save(V1, store).checksum
    assert main(["config", "show", "1", "--store", str(store)]) == 0
    assert capsys.readouterr().out == (
        "version 1\n"
        "parent: none (initial)\n"
        "created by initial at 2026-11-03T12:30:00+00:00\n"
        f"checksum: {checksum}\n"
        "operator by_region: parallelism 4, 3 tabled keys, 1 hot key\n"
        "  hot keys (widest 1):\n"
        "    America: d=3 [1, 2, 3]\n"
        "  tabled keys per instance:\n"
        "    0: 1\n"
        "    1: 1\n"
        "    2: 0\n"
        "    3: 1\n"
        "operator by_hashtag: parallelism 3, 2 tabled keys, 1 hot key\n"
        "  hot keys (widest 1):\n"
        "    #java: d=2 [0, 1]\n"
        "  tabled keys per instance:\n"
        "    0: 1\n"
        "    1: 1\n"
        "    2: 0\n"
    )


def test_diff_lists_moves_hot_key_changes_transfers_and_cost(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    none = store / "no-statistics"
    assert main(["config", "diff", "1", "2", "--store", str(store), "--statistics", str(none)]) == 0
    assert capsys.readouterr().out == (
        "diff version 1 → 2\n"
        "operator by_region: parallelism 4\n"
        "  moved keys: 4\n"
        "    Africa: 1 → [1, 0]\n"
        "    America: [1, 2, 3] → 1\n"
        "    Asia: 0 → 2\n"
        "    Oceania: 1 → 0\n"
        "  hot keys added: 1\n"
        "    Africa: d 1 → 2\n"
        "  hot keys removed: 1\n"
        "    America: d 3 → 1\n"
        "  transfers per instance:\n"
        "    0: sends 1, receives 1\n"
        "    1: sends 1, receives 2\n"
        "    2: sends 1, receives 1\n"
        "    3: sends 1, receives 0\n"
        "  estimated cost: 4 keys, 4 transfers\n"
        "operator by_hashtag: parallelism 3\n"
        "  moved keys: 2\n"
        "    #java: [0, 1] → [0, 1, 2]\n"
        "    #rust: 0 → 2\n"
        "  hot keys resized: 1\n"
        "    #java: d 2 → 3\n"
        "  transfers per instance:\n"
        "    0: sends 1, receives 0\n"
        "    2: sends 0, receives 1\n"
        "  estimated cost: 2 keys, 1 transfer\n"
        "estimated migration cost: 6 keys, 5 transfers\n"
        f"expected gain: no statistics snapshot in {none} (the DAG writes them)\n"
    )


def test_diff_of_a_version_with_itself_moves_nothing(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    none = store / "no-statistics"
    assert main(["config", "diff", "2", "2", "--store", str(store), "--statistics", str(none)]) == 0
    out = capsys.readouterr().out
    assert out.count("  moved keys: 0\n") == 2
    assert "transfers per instance" not in out
    assert "estimated migration cost: 0 keys, 0 transfers\n" in out


def test_reports_list_the_first_ten_and_count_the_rest() -> None:
    many = {f"k{i:02d}": 0 for i in range(12)}
    hot = {f"h{i:02d}": (0, 1, 2)[: 2 + i % 2] for i in range(12)}
    old = RoutingConfig(
        version=1,
        created_at=CREATED,
        created_by="initial",
        operators={
            "op": OperatorRouting(
                parallelism=4,
                table=many,
                hot_keys={f"h{i:02d}": (0, 1, 2)[: 2 + i % 2] for i in range(12)},
            )
        },
    )
    new = RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={"op": OperatorRouting(parallelism=4, table=dict.fromkeys([*many, *hot], 3))},
    )
    shown = render_config(old, "c0ffee").splitlines()
    widest = shown[shown.index("  hot keys (widest 10):") + 1 : shown.index("    ... and 2 more")]
    assert widest[:6] == [f"    h{i:02d}: d=3 [0, 1, 2]" for i in (1, 3, 5, 7, 9, 11)]
    assert widest[6:] == [f"    h{i:02d}: d=2 [0, 1]" for i in (0, 2, 4, 6)]
    lines = render_diff(old, new).splitlines()
    moved = lines.index("  moved keys: 24")
    assert lines[moved + 1 : moved + 12] == [
        *(f"    h{i:02d}: {[0, 1, 2][: 2 + i % 2]} → 3" for i in range(10)),
        "    ... and 14 more",
    ]


def test_default_store_is_under_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    assert Settings().config_store == tmp_path / "configs"
    save(V1, tmp_path / "configs")
    assert main(["config", "show"]) == 0
    assert capsys.readouterr().out.startswith("version 1\nparent: none (initial)\n")


def test_unknown_version_lists_the_stored_ones(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = (
        f"keyplane: no configuration version 7 in {store}; stored versions: 1, 2; "
        "pass one of the stored versions"
    )
    assert _error(capsys, ["config", "show", "7", "--store", str(store)]) == expected
    assert _error(capsys, ["config", "diff", "1", "7", "--store", str(store)]) == expected


def test_tampered_file_is_named(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tampered = store / "v000002" / "operator-000.table.parquet"
    tampered.write_bytes(tampered.read_bytes() + b"\0")
    line = _error(capsys, ["config", "diff", "1", "2", "--store", str(store)])
    assert line.startswith(f"keyplane: {tampered} has SHA-256 ")
    assert line.endswith(
        "the file was modified after it was saved; "
        "restore the file from a backup or publish a new version"
    )
    assert main(["config", "show", "1", "--store", str(store)]) == 0


def test_empty_store_says_to_publish_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "nothing"
    expected = f"keyplane: no configuration stored in {empty}; publish one first"
    assert _error(capsys, ["config", "show", "--store", str(empty)]) == expected
    assert _error(capsys, ["config", "diff", "1", "2", "--store", str(empty)]) == expected


def test_diff_of_different_pipelines_is_refused(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = RoutingConfig(
        version=3,
        parent_version=2,
        created_by="manual",
        operators={"by_city": OperatorRouting(parallelism=2)},
    )
    save(other, store)
    assert _error(capsys, ["config", "diff", "2", "3", "--store", str(store)]) == (
        "keyplane: versions 2 and 3 route different operators (by_region, by_hashtag vs "
        "by_city); diff two versions of the same pipeline"
    )


@pytest.mark.parametrize("argv", [["config"], ["config", "show"], ["config", "diff"]])
def test_help_exits_zero(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: keyplane {' '.join(argv)} ")


def test_version_must_be_a_positive_integer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", "0"])
    assert exit_info.value.code == 2
    assert "'0' is not a version (an integer from 1)" in capsys.readouterr().err


def test_show_defaults_to_the_active_version_and_list_hides_versions_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """v3 was planned by a run that decided not to publish it: before any rollout the
    active version is v2, the newest that was not left unpublished; once the controller
    has a rollout on record, its active version is the one shown."""
    from keyplane.control.controller import ControllerFile
    from keyplane.control.controller_protocol import ControllerState
    from keyplane.routing.config import mark_not_published

    monkeypatch.setenv("KEYPLANE_HOME", str(tmp_path))
    store = tmp_path / "configs"
    save(V1, store)
    save(V2, store)
    save(V2.model_copy(update={"version": 3}), store)
    mark_not_published(store, 3, "gain +0.0010 below min_gain 0.01", "scheduled__x")

    assert main(["config", "show"]) == 0
    assert capsys.readouterr().out.startswith("version 2\n")
    assert main(["config", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed[:-1]] == ["v2", "v1"]
    assert listed[0].endswith("active")
    assert listed[-1].startswith("(1 versions planned but not published are hidden")
    assert main(["config", "list", "--all"]) == 0
    everything = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in everything] == ["v3", "v2", "v1"]
    assert everything[0].endswith("not published: gain +0.0010 below min_gain 0.01")

    state = ControllerState(
        operators=("by_region", "by_hashtag"), active_version=1, active_checksum="c"
    )
    (tmp_path / "controller.json").write_text(
        ControllerFile(control_topic="c", read_offset=0, protocol=state).model_dump_json()
    )
    assert main(["config", "show"]) == 0
    assert capsys.readouterr().out.startswith("version 1\n")

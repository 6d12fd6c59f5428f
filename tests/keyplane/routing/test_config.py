"""Tests of the versioned routing configuration and its checksummed store."""

from __future__ import annotations

import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from keyplane.routing import config as config_module
from keyplane.routing.config import (
    ChecksumMismatchError,
    ConfigStoreError,
    OperatorRouting,
    RoutingConfig,
    UnknownVersionError,
    UnsupportedFormatError,
    VersionConflictError,
    checksum,
    latest_version,
    load,
    save,
    stored_versions,
)

CREATED = datetime(2026, 11, 3, 12, 30, tzinfo=UTC)


def example_config(version: int = 2, parent: int | None = 1) -> RoutingConfig:
    return RoutingConfig(
        version=version,
        parent_version=parent,
        created_at=CREATED,
        created_by="schedule" if parent is not None else "initial",
        operators={
            "by_region": OperatorRouting(
                parallelism=4,
                table={"Asia": 0, "Europe": 3, "Océanie": 1},
                hot_keys={"America": (1, 2, 3)},
            ),
            "by_hashtag": OperatorRouting(
                parallelism=2, table={"#scala": 1}, hot_keys={"#java": (0, 1)}
            ),
        },
    )


def test_save_then_load_returns_an_equal_config(tmp_path: Path) -> None:
    original = example_config()
    saved = save(original, tmp_path)

    assert saved.path == tmp_path / "v000002"
    assert saved.checksum == checksum(tmp_path, 2)
    loaded = load(tmp_path, 2, expected_checksum=saved.checksum)
    assert loaded == original
    assert list(loaded.operators) == ["by_region", "by_hashtag"]


def test_a_modified_data_file_is_rejected_naming_the_file(tmp_path: Path) -> None:
    saved = save(example_config(), tmp_path)
    table_file = saved.path / "operator-000.table.parquet"
    table = pq.read_table(table_file).to_pydict()
    table["instance"][0] = 2
    pq.write_table(pa.table(table), table_file)

    with pytest.raises(ChecksumMismatchError, match=r"operator-000\.table\.parquet"):
        load(tmp_path, 2)


def test_a_modified_manifest_is_rejected_naming_the_manifest(tmp_path: Path) -> None:
    saved = save(example_config(), tmp_path)
    manifest_path = saved.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["operators"][0]["parallelism"] = 8
    manifest_path.write_text(json.dumps(manifest))

    with pytest.raises(ChecksumMismatchError, match=r"manifest\.json"):
        load(tmp_path, 2)


def _rewrite_manifest(folder: Path, change: Any) -> None:
    """Apply ``change`` to the manifest's body and record the matching checksum, as a
    writer of that manifest would have (a tampered one is the test above)."""
    manifest_path = folder / "manifest.json"
    body = json.loads(manifest_path.read_text())
    del body["checksum"]
    change(body)
    body["checksum"] = config_module._body_checksum(body)
    manifest_path.write_text(json.dumps(body))


def test_a_newer_store_format_is_refused_not_read_in_part(tmp_path: Path) -> None:
    saved = save(example_config(), tmp_path)
    _rewrite_manifest(saved.path, lambda body: body.update(format=2, shards=["a", "b"]))

    with pytest.raises(UnsupportedFormatError, match=r"store format 2, .* reads format 1 only"):
        load(tmp_path, 2)
    with pytest.raises(UnsupportedFormatError):
        checksum(tmp_path, 2)


def test_a_manifest_checksummed_but_without_its_files_names_the_version(tmp_path: Path) -> None:
    saved = save(example_config(), tmp_path)
    _rewrite_manifest(saved.path, lambda body: body["operators"][0].pop("table_file"))

    with pytest.raises(ConfigStoreError, match=r"v000002 is not a configuration .* 'table_file'"):
        load(tmp_path, 2)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (b"\xff\xfe", "is not valid JSON"),
        (b"[]", "not a manifest: a JSON list"),
        (b'{"format": 1, "files": []}', "lists its files as a JSON list"),
    ],
    ids=["not-utf-8", "a-list", "files-a-list"],
)
def test_a_manifest_that_is_not_an_object_is_a_clear_error(
    tmp_path: Path, contents: bytes, message: str
) -> None:
    saved = save(example_config(), tmp_path)
    (saved.path / "manifest.json").write_bytes(contents)

    with pytest.raises(ChecksumMismatchError, match=message):
        load(tmp_path, 2)


def test_versions_past_six_digits_are_listed_and_loaded(tmp_path: Path) -> None:
    save(example_config(999_999, None), tmp_path)
    save(example_config(1_000_000, 999_999), tmp_path)

    assert stored_versions(tmp_path) == [999_999, 1_000_000]
    assert latest_version(tmp_path) == 1_000_000
    assert load(tmp_path, 1_000_000) == example_config(1_000_000, 999_999)


def test_an_unexpected_published_checksum_is_rejected(tmp_path: Path) -> None:
    save(example_config(), tmp_path)
    with pytest.raises(ChecksumMismatchError, match="expected 00ff"):
        load(tmp_path, 2, expected_checksum="00ff")


def test_an_unknown_version_is_a_clear_error_listing_stored_versions(tmp_path: Path) -> None:
    save(example_config(), tmp_path)
    with pytest.raises(
        UnknownVersionError, match=r"no configuration version 7 .* stored versions: 2"
    ):
        load(tmp_path, 7)
    with pytest.raises(UnknownVersionError, match="stored versions: none"):
        load(tmp_path / "empty", 1)


def test_saving_the_same_config_twice_is_a_no_op(tmp_path: Path) -> None:
    first = save(example_config(), tmp_path)
    manifest_mtime = (first.path / "manifest.json").stat().st_mtime_ns
    second = save(example_config(), tmp_path)

    assert second == first
    assert (first.path / "manifest.json").stat().st_mtime_ns == manifest_mtime
    assert stored_versions(tmp_path) == [2]


def test_a_file_without_created_at_published_twice_is_a_repeat(tmp_path: Path) -> None:
    """``created_at`` defaults to the time the file is read, so the second read differs
    in it alone: when a configuration was made is not what it routes."""
    text = json.dumps(
        {"version": 1, "created_by": "initial", "operators": {"A": {"parallelism": 2}}}
    )
    first = save(RoutingConfig.model_validate_json(text), tmp_path)
    later = RoutingConfig.model_validate_json(text).model_copy(
        update={"created_at": datetime(2030, 1, 1, tzinfo=UTC)}
    )

    assert save(later, tmp_path) == first
    assert load(tmp_path, 1).created_at != later.created_at


def test_saving_a_different_config_under_an_existing_version_is_an_error(tmp_path: Path) -> None:
    save(example_config(), tmp_path)
    changed = RoutingConfig(
        version=2,
        parent_version=1,
        created_at=CREATED,
        created_by="manual",
        operators={"by_region": OperatorRouting(parallelism=4)},
    )
    with pytest.raises(VersionConflictError, match="version 2 is already stored"):
        save(changed, tmp_path)
    assert load(tmp_path, 2) == example_config()


def test_a_crash_while_writing_leaves_no_version_with_fake_failing_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_write = pq.write_table

    def failing_write(table: Any, where: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real_write(table, where, **kwargs)

    monkeypatch.setattr(config_module.pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        save(example_config(), tmp_path)

    assert latest_version(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_latest_version_ignores_unfinished_directories(tmp_path: Path) -> None:
    assert latest_version(tmp_path) is None
    save(example_config(1, None), tmp_path)
    save(example_config(3, 1), tmp_path)
    unfinished = tmp_path / ".tmp-v000009-abc"
    unfinished.mkdir()
    (unfinished / "manifest.json").write_text("{}")

    assert latest_version(tmp_path) == 3
    assert stored_versions(tmp_path) == [1, 3]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"table": {"k": 4}}, r"outside instances \[0, 4\): 'k'→4"),
        ({"table": {"k": -1}}, "outside instances"),
        ({"table": {"k": 1}, "hot_keys": {"k": (0, 1)}}, "both in the table and hot: 'k'"),
        ({"hot_keys": {"k": (2,)}}, "at least 2 instances: 'k'"),
        ({"hot_keys": {"k": (1, 1)}}, "instance twice: 'k'"),
        ({"hot_keys": {"k": (0, 9)}}, r"outside \[0, 4\)"),
        ({"placement": {0: "e"}}, "placement\n  Extra inputs are not permitted"),
        ({"parallelism": 0}, "greater than or equal to 1"),
        ({"parallelism": True}, "expected an integer, got true"),
        ({"active_instances": 1}, "active_instances\n  Input should be a valid tuple"),
        ({"table": {"k": True}}, r"table\.k\n  Value error, expected an integer, got true"),
        ({"hot_keys": {"k": (True, False)}}, "expected an integer, got true"),
        ({"active_instances": (False, True)}, "expected an integer, got false"),
    ],
)
def test_operator_invariant_violations_are_rejected(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        OperatorRouting(**{"parallelism": 4, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"version": 3, "parent_version": 3}, "must be greater than its parent_version 3"),
        ({"version": 1, "parent_version": None, "created_by": "manual"}, "only an 'initial'"),
        ({"version": 2, "parent_version": 1, "created_by": "initial"}, "only an 'initial'"),
        ({"version": 0, "parent_version": None, "created_by": "initial"}, "greater than or equal"),
        ({"operators": {}}, "at least one operator"),
        ({"created_at": datetime(2026, 1, 1)}, "timezone"),
        ({"created_by": "cron"}, "'initial', 'schedule'"),
        ({"version": True, "parent_version": None, "created_by": "initial"}, "got true"),
    ],
)
def test_config_invariant_violations_are_rejected(fields: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "version": 2,
        "parent_version": 1,
        "created_at": CREATED,
        "created_by": "schedule",
        "operators": {"op": OperatorRouting(parallelism=2)},
    }
    with pytest.raises(ValidationError, match=message):
        RoutingConfig(**{**base, **fields})


@pytest.mark.parametrize("parallelism", [3.0, "3"])
def test_a_file_with_every_instance_active_stores_the_same_version_twice(
    tmp_path: Path, parallelism: object
) -> None:
    """A parallelism read as an integer (3.0, "3") is normalised as 3 is, so the file
    equals the normalised copy loaded back from the store and a repeat is a no-op."""
    text = json.dumps(
        {
            "version": 1,
            "created_at": CREATED.isoformat(),
            "created_by": "initial",
            "operators": {"A": {"parallelism": parallelism, "active_instances": [0, 1, 2]}},
        }
    )
    config = RoutingConfig.model_validate_json(text)

    first = save(config, tmp_path)
    again = save(RoutingConfig.model_validate_json(text), tmp_path)

    assert config.operators["A"].active_instances is None
    assert again == first


def test_configs_are_frozen() -> None:
    config = example_config()
    with pytest.raises(ValidationError, match="frozen"):
        config.version = 5
    with pytest.raises(ValidationError, match="frozen"):
        config.operators["by_region"].parallelism = 8


@st.composite
def configs(draw: st.DrawFn) -> RoutingConfig:
    operators: dict[str, OperatorRouting] = {}
    for name in draw(
        st.lists(
            st.text(min_size=1, max_size=6).filter(str.strip), min_size=1, max_size=3, unique=True
        )
    ):
        parallelism = draw(st.integers(1, 6))
        keys = draw(st.lists(st.text(max_size=5), max_size=12, unique=True))
        table: dict[str, int] = {}
        hot: dict[str, tuple[int, ...]] = {}
        for key in keys:
            if parallelism >= 2 and draw(st.booleans()):
                hot[key] = tuple(
                    draw(st.permutations(range(parallelism)))[: draw(st.integers(2, parallelism))]
                )
            else:
                table[key] = draw(st.integers(0, parallelism - 1))
        operators[name] = OperatorRouting(parallelism=parallelism, table=table, hot_keys=hot)
    return RoutingConfig(
        version=draw(st.integers(1, 999_999)),
        created_at=CREATED,
        created_by="initial",
        operators=operators,
    )


@settings(max_examples=30, deadline=None)
@given(configs())
def test_property_any_valid_config_round_trips_through_the_store(config: RoutingConfig) -> None:
    with tempfile.TemporaryDirectory() as directory:
        saved = save(config, directory)
        assert load(directory, config.version, expected_checksum=saved.checksum) == config


def test_all_hash_is_an_initial_version_with_hash_routing_for_each_operator() -> None:
    config = RoutingConfig.all_hash(4, ("A", "B"))
    assert (config.version, config.parent_version, config.created_by) == (1, None, "initial")
    assert list(config.operators) == ["A", "B"]
    for routing in config.operators.values():
        assert routing == OperatorRouting(parallelism=4)

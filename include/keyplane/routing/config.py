"""The routing configuration: versioned, immutable, checksummed on stable storage.

A configuration says, for every stateful operator, how many instances it has,
which keys a routing table pins to an instance (paper 000 §3.3), which hot
keys are split over several instances (paper 001 §4.2), and optionally which
executor hosts each instance. Paper 000 §3.4 saves every routing configuration
to stable storage before a reconfiguration starts, so that a crash during
migration can be recovered; keyplane also keeps old versions so that a bad
configuration can be rolled back, and names each version's parent.

On disk a version is a directory ``v{version:06d}/`` holding one Parquet file
per operator for the table and one for the hot keys, plus ``manifest.json``
with the metadata, each data file's SHA-256, and a checksum over all of it.
The control topic carries (version, checksum), so a reader verifies it loads
exactly the configuration that was published. A version is written to a
temporary directory and renamed into place, so a crash never leaves a half
written version, and a published version never changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from keyplane.util.parquet_files import read_table

CreatedBy = Literal["initial", "schedule", "manual", "event", "rollback", "scale"]
"""Who made a version: ``event`` is a run the job's own metrics started (an asset event)."""

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
_VERSION_DIRECTORY = re.compile(r"^v(\d{6,})$")
_MAX_REPORTED = 5


def _not_a_boolean(value: Any) -> Any:
    """JSON's ``true`` is not the integer 1: pydantic would read it as one."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {str(value).lower()}")
    return value


Count = Annotated[int, BeforeValidator(_not_a_boolean)]
"""An integer field of a configuration file: a number, never a boolean."""

Instance = Annotated[int, BeforeValidator(_not_a_boolean)]
"""An operator instance's number, from 0: like a :data:`Count`, a number, never a boolean.

Its range depends on the operator's parallelism, so the invariants check it,
naming each key routed outside it."""


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_REPORTED])
    more = len(items) - _MAX_REPORTED
    return shown + (f" and {more} more" if more > 0 else "")


class OperatorRouting(BaseModel):
    """How one stateful operator routes its keys.

    A key in ``table`` goes to that instance; a key in ``hot_keys`` is split
    over the listed instances (at least two, distinct); any other key takes
    the hash fallback. Keys are strings here: the edge maps them to and from
    the integer ids the algorithms use.

    ``active_instances`` is the scaling state (paper 003; Stela adds and
    removes instances). Spark fixes the number of state partitions for the
    life of a checkpoint, so ``parallelism`` never changes live; scaling
    changes which instances hold keys, as Flink's key groups do under a fixed
    max parallelism. ``None`` means every instance is active. Otherwise the
    table and the hot keys use active instances only, and the hash fallback
    folds a key whose natural partition is inactive onto an active one
    (:func:`keyplane.routing.routedkeys.fold_instance`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    parallelism: Count = Field(ge=1)
    table: dict[str, Instance] = Field(default_factory=dict)
    hot_keys: dict[str, tuple[Instance, ...]] = Field(default_factory=dict)
    active_instances: tuple[Instance, ...] | None = None

    @property
    def active(self) -> tuple[int, ...]:
        """The instances that hold keys, ascending (every instance when not scaled)."""
        if self.active_instances is None:
            return tuple(range(self.parallelism))
        return self.active_instances

    @field_validator("active_instances")
    @classmethod
    def _all_active_is_unscaled(
        cls, active: tuple[int, ...] | None, info: ValidationInfo
    ) -> tuple[int, ...] | None:
        """Every instance active is written as ``None``: one configuration, one checksum.

        Compared once both fields are validated, so a parallelism given as
        ``3.0`` or ``"3"`` (read as 3) is normalised as ``3`` is: the stored
        copy is always normalised, and an unnormalised file would differ from
        it, so publishing that file again would conflict with itself.
        """
        p = info.data.get("parallelism")
        if active is not None and p is not None and active == tuple(range(p)):
            return None
        return active

    @model_validator(mode="after")
    def _check_invariants(self) -> Self:
        p = self.parallelism
        outside = [f"{k!r}→{i}" for k, i in self.table.items() if not 0 <= i < p]
        if outside:
            raise ValueError(f"table routes keys outside instances [0, {p}): {_listing(outside)}")
        both = [repr(k) for k in self.hot_keys if k in self.table]
        if both:
            raise ValueError(f"keys both in the table and hot: {_listing(both)}")
        short = [repr(k) for k, inst in self.hot_keys.items() if len(inst) < 2]
        if short:
            raise ValueError(f"hot keys need at least 2 instances: {_listing(short)}")
        repeated = [repr(k) for k, inst in self.hot_keys.items() if len(set(inst)) != len(inst)]
        if repeated:
            raise ValueError(f"hot keys list an instance twice: {_listing(repeated)}")
        hot_outside = [
            f"{k!r}→{list(inst)}"
            for k, inst in self.hot_keys.items()
            if any(not 0 <= i < p for i in inst)
        ]
        if hot_outside:
            raise ValueError(f"hot keys use instances outside [0, {p}): {_listing(hot_outside)}")
        if self.active_instances is not None:
            self._check_active(self.active_instances)
        return self

    def _check_active(self, active: tuple[int, ...]) -> None:
        p = self.parallelism
        if not active:
            raise ValueError("active_instances must name at least one instance")
        if list(active) != sorted(set(active)):
            raise ValueError(f"active_instances must be ascending and distinct, got {list(active)}")
        if active[0] < 0 or active[-1] >= p:
            raise ValueError(f"active_instances must lie in [0, {p}), got {list(active)}")
        allowed = set(active)
        idle = [f"{k!r}→{i}" for k, i in self.table.items() if i not in allowed]
        if idle:
            raise ValueError(f"table routes keys to inactive instances: {_listing(idle)}")
        hot_idle = [
            f"{k!r}→{list(inst)}"
            for k, inst in self.hot_keys.items()
            if any(i not in allowed for i in inst)
        ]
        if hot_idle:
            raise ValueError(f"hot keys use inactive instances: {_listing(hot_idle)}")


class RoutingConfig(BaseModel):
    """One version of the routing of every stateful operator.

    ``operators`` is listed upstream first. ``parent_version`` is the version
    this one replaces: only the initial configuration has none, and a child is
    always newer than its parent.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Count = Field(ge=1)
    parent_version: Count | None = Field(default=None, ge=1)
    created_at: AwareDatetime = Field(default_factory=lambda: datetime.now(UTC))
    created_by: CreatedBy
    operators: dict[str, OperatorRouting]

    @model_validator(mode="after")
    def _check_lineage(self) -> Self:
        if self.parent_version is not None and self.version <= self.parent_version:
            raise ValueError(
                f"version {self.version} must be greater than its parent_version "
                f"{self.parent_version}"
            )
        if (self.created_by == "initial") != (self.parent_version is None):
            raise ValueError(
                "only an 'initial' configuration has no parent_version "
                f"(created_by={self.created_by!r}, parent_version={self.parent_version})"
            )
        if not self.operators:
            raise ValueError("a configuration routes at least one operator")
        unnamed = [name for name in self.operators if not name.strip()]
        if unnamed:
            raise ValueError("operator names must not be blank")
        return self

    @classmethod
    def all_hash(cls, parallelism: int, operators: Sequence[str]) -> RoutingConfig:
        """Version 1 of a new job: every operator on hash routing (no table, no hot keys)."""
        return cls(
            version=1,
            created_by="initial",
            operators={name: OperatorRouting(parallelism=parallelism) for name in operators},
        )


def check_same_operators(old: RoutingConfig, new: RoutingConfig) -> None:
    """Raise ``ValueError`` unless ``new`` routes exactly ``old``'s operators.

    A migration moves each operator's keys from its old instances to its new
    ones (000 §3.4); an operator routed by only one of the two has nothing
    to move from or to, and the running job's stages are fixed.
    """
    if set(old.operators) != set(new.operators):
        raise ValueError(
            "old and new configurations must route the same operators: "
            f"{sorted(old.operators)} vs {sorted(new.operators)}"
        )


class ConfigStoreError(Exception):
    """A configuration could not be saved or loaded as asked."""


class UnknownVersionError(ConfigStoreError, LookupError):
    """No configuration with the requested version is stored."""


class ChecksumMismatchError(ConfigStoreError):
    """Stored bytes differ from what the manifest (or the caller) expects."""


class VersionConflictError(ConfigStoreError):
    """A different configuration is already stored under this version."""


class UnsupportedFormatError(ConfigStoreError):
    """A stored version is in a store format this keyplane does not read (a newer one).

    Reading it anyway would drop what a newer format added without a word;
    a job refuses the version instead, and stays on the one it runs.
    """


@dataclass(frozen=True)
class SavedConfig:
    """Where a version was stored and the checksum to publish with it."""

    version: int
    path: Path
    checksum: str


def version_path(directory: Path | str, version: int) -> Path:
    return Path(directory) / f"v{version:06d}"


def stored_versions(directory: Path | str) -> list[int]:
    """Every complete stored version, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    versions = []
    for entry in root.iterdir():
        match = _VERSION_DIRECTORY.match(entry.name)
        if match and (entry / MANIFEST_NAME).is_file():
            versions.append(int(match.group(1)))
    return sorted(versions)


def latest_version(directory: Path | str) -> int | None:
    """The newest stored version, or ``None`` when nothing is stored yet."""
    versions = stored_versions(directory)
    return versions[-1] if versions else None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _body_checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _write_operator_files(operator: OperatorRouting, index: int, target: Path) -> tuple[str, str]:
    table_name = f"operator-{index:03d}.table.parquet"
    hot_name = f"operator-{index:03d}.hot_keys.parquet"
    table_keys = sorted(operator.table)
    pq.write_table(
        pa.table(
            {
                "key": pa.array(table_keys, pa.string()),
                "instance": pa.array([operator.table[k] for k in table_keys], pa.int32()),
            }
        ),
        target / table_name,
    )
    hot_keys = sorted(operator.hot_keys)
    pq.write_table(
        pa.table(
            {
                "key": pa.array(hot_keys, pa.string()),
                "instances": pa.array(
                    [list(operator.hot_keys[k]) for k in hot_keys], pa.list_(pa.int32())
                ),
            }
        ),
        target / hot_name,
    )
    return table_name, hot_name


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_version(config: RoutingConfig, target: Path) -> str:
    """Write every file of ``config`` into the empty directory ``target``."""
    operators = []
    for index, (name, operator) in enumerate(config.operators.items()):
        table_name, hot_name = _write_operator_files(operator, index, target)
        operators.append(
            {
                "name": name,
                "parallelism": operator.parallelism,
                # Store format 1 has this field; keyplane places no instances on executors.
                "placement": None,
                "table_file": table_name,
                "hot_keys_file": hot_name,
                # Written only when scaled, so the manifests (and checksums) of
                # unscaled configurations are byte for byte what they were.
                **(
                    {}
                    if operator.active_instances is None
                    else {"active_instances": list(operator.active_instances)}
                ),
            }
        )
    files = {
        entry.name: _file_sha256(entry) for entry in sorted(target.iterdir()) if entry.is_file()
    }
    body: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "version": config.version,
        "parent_version": config.parent_version,
        "created_at": config.created_at.isoformat(),
        "created_by": config.created_by,
        "operators": operators,
        "files": files,
    }
    checksum = _body_checksum(body)
    (target / MANIFEST_NAME).write_text(
        json.dumps({**body, "checksum": checksum}, indent=2, ensure_ascii=False) + "\n"
    )
    for entry in target.iterdir():
        _fsync(entry)
    _fsync(target)
    return checksum


def save(config: RoutingConfig, directory: Path | str) -> SavedConfig:
    """Store ``config`` as ``directory/v{version:06d}/`` atomically.

    Saving a configuration equal to the stored one is a no-op; saving a
    different one under an existing version raises :class:`VersionConflictError`
    (a published version must never change under its readers). Equal means
    equal but for ``created_at``: that is when the configuration was made,
    not what it routes, and a file published without one gets the time it is
    read, so publishing it again must still be a repeat.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = version_path(root, config.version)
    if final.exists():
        return _existing(config, root)
    staging = root / f".tmp-{final.name}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        digest = _write_version(config, staging)
        try:
            staging.rename(final)
        except OSError:
            if final.exists():
                return _existing(config, root)
            raise
        _fsync(root)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return SavedConfig(config.version, final, digest)


def check_storable(config: RoutingConfig, directory: Path | str) -> None:
    """Raise :class:`VersionConflictError` if ``directory`` holds other contents under
    ``config``'s version: :func:`save` would refuse it, and a caller may want to know before
    it does anything else."""
    root = Path(directory)
    if version_path(root, config.version).exists():
        _existing(config, root)


def _existing(config: RoutingConfig, root: Path) -> SavedConfig:
    stored = load(root, config.version)
    if stored.model_copy(update={"created_at": config.created_at}) != config:
        raise VersionConflictError(
            f"version {config.version} is already stored in {root} with different contents; "
            "a new configuration needs a new version"
        )
    return SavedConfig(
        config.version, version_path(root, config.version), checksum(root, config.version)
    )


def _read_manifest(root: Path, version: int) -> dict[str, Any]:
    manifest_path = version_path(root, version) / MANIFEST_NAME
    if not manifest_path.is_file():
        known = stored_versions(root)
        raise UnknownVersionError(
            f"no configuration version {version} in {root}; stored versions: "
            f"{_listing([str(v) for v in known]) if known else 'none'}"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ChecksumMismatchError(f"{manifest_path} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict):
        raise ChecksumMismatchError(
            f"{manifest_path} is not a manifest: a JSON {type(manifest).__name__}, not an object"
        )
    if manifest.get("format") != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{manifest_path} is in store format {manifest.get('format')!r}, and this keyplane "
            f"reads format {FORMAT_VERSION} only"
        )
    return manifest


def checksum(directory: Path | str, version: int) -> str:
    """The checksum recorded for a stored version (what is published with it)."""
    return str(_read_manifest(Path(directory), version)["checksum"])


def load(
    directory: Path | str, version: int, expected_checksum: str | None = None
) -> RoutingConfig:
    """Read and verify a stored version.

    Every data file must match its SHA-256 in the manifest, the manifest must
    match its own checksum, and that checksum must equal ``expected_checksum``
    when given (the one published with the version).
    """
    root = Path(directory)
    folder = version_path(root, version)
    manifest = _read_manifest(root, version)
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    files = body.get("files", {})
    if not isinstance(files, dict):
        raise ChecksumMismatchError(
            f"{folder / MANIFEST_NAME} lists its files as a JSON {type(files).__name__}, "
            "not an object of name → SHA-256"
        )
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise ChecksumMismatchError(f"{path} is listed in the manifest but missing")
        actual = _file_sha256(path)
        if actual != expected:
            raise ChecksumMismatchError(
                f"{path} has SHA-256 {actual}, but the manifest records {expected}: "
                "the file was modified after it was saved"
            )
    recorded = manifest.get("checksum")
    if _body_checksum(body) != recorded:
        raise ChecksumMismatchError(
            f"{folder / MANIFEST_NAME} does not match its own checksum {recorded}: "
            "the manifest was modified after it was saved"
        )
    if expected_checksum is not None and recorded != expected_checksum:
        raise ChecksumMismatchError(
            f"version {version} in {root} has checksum {recorded}, expected {expected_checksum}"
        )
    if body.get("version") != version:
        raise ConfigStoreError(
            f"{folder / MANIFEST_NAME} describes version {body.get('version')}, not {version}"
        )
    try:
        return _config_of(body, folder)
    except (KeyError, TypeError, AttributeError, pa.ArrowException) as error:
        # The checksums matched: these files were written this way, not damaged later.
        raise ConfigStoreError(
            f"{folder} is not a configuration this keyplane can read "
            f"({type(error).__name__}: {error})"
        ) from None


def _config_of(body: dict[str, Any], folder: Path) -> RoutingConfig:
    """The configuration a verified manifest ``body`` describes, its files in ``folder``."""
    operators: dict[str, OperatorRouting] = {}
    for entry in body["operators"]:
        table = read_table(folder / entry["table_file"]).to_pydict()
        hot = read_table(folder / entry["hot_keys_file"]).to_pydict()
        operators[entry["name"]] = OperatorRouting(
            parallelism=entry["parallelism"],
            table=dict(zip(table["key"], table["instance"], strict=True)),
            hot_keys={k: tuple(v) for k, v in zip(hot["key"], hot["instances"], strict=True)},
            active_instances=None
            if entry.get("active_instances") is None
            else tuple(entry["active_instances"]),
        )
    return RoutingConfig(
        version=body["version"],
        parent_version=body["parent_version"],
        created_at=datetime.fromisoformat(body["created_at"]),
        created_by=body["created_by"],
        operators=operators,
    )


# --- versions planned but never published -------------------------------------------------

NOT_PUBLISHED_PREFIX = "not-published-v"
"""``<store>/not-published-v<version>.json``: the run that planned the version chose not to
publish it (its decision, a dry run, a failed validation). Kept beside the version, not in
it: a version's files and checksum never change once stored."""


def _not_published_path(root: Path, version: int) -> Path:
    return root / f"{NOT_PUBLISHED_PREFIX}{version:06d}.json"


def mark_not_published(directory: Path | str, version: int, reason: str, run_id: str) -> None:
    """Record that ``version`` was planned and will not be published, and why.

    Written once: the first reason stands, as the run's decision does.
    """
    path = _not_published_path(Path(directory), version)
    if path.is_file():
        return
    record = {"version": version, "reason": reason, "run_id": run_id}
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    staging.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    staging.replace(path)


def not_published(directory: Path | str) -> dict[int, dict[str, Any]]:
    """Each version marked as planned but not published, with its record."""
    root = Path(directory)
    found: dict[int, dict[str, Any]] = {}
    if not root.is_dir():
        return found
    for path in root.glob(f"{NOT_PUBLISHED_PREFIX}*.json"):
        digits = path.stem.removeprefix(NOT_PUBLISHED_PREFIX)
        if not digits.isdigit():
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = {}
        found[int(digits)] = record if isinstance(record, dict) else {}
    return found


def prune_not_published(
    directory: Path | str, keep: int, protected: Sequence[int] = ()
) -> list[int]:
    """Delete all but the newest ``keep`` versions marked not published; return those deleted.

    A scheduled run that finds nothing worth publishing still plans and
    stores a version, so without pruning the store grows by one version a
    run. Never deleted: the newest stored version (the next version number
    is the newest + 1, and a number must never be given to two different
    configurations), and ``protected`` (the active version and any in
    flight, which a hand-made ``keyplane config publish`` may have taken).
    A version's validation record goes with it.
    """
    root = Path(directory)
    marked = sorted(not_published(root))
    stored = stored_versions(root)
    newest = stored[-1] if stored else None
    kept = set(protected) | {newest}
    doomed = [v for v in marked[: max(0, len(marked) - keep)] if v not in kept]
    for version in doomed:
        folder = version_path(root, version)
        if folder.exists():
            # Renamed away first, so a reader never sees a version half deleted.
            trash = root / f".tmp-pruned-{folder.name}-{uuid.uuid4().hex}"
            folder.rename(trash)
            shutil.rmtree(trash)
        (root / f"validation-v{version:06d}.json").unlink(missing_ok=True)
        _not_published_path(root, version).unlink()
    return doomed

"""A DAG run's folder and the records its steps leave there, written once.

Every step of the reconfiguration and scale DAGs takes the
:class:`~keyplane.orchestration.deployment.Deployment` and the DAG run's id,
reads what earlier steps left in the run's folder, and returns a small
JSON-able dict (the task's XCom). Idempotence, since Airflow retries tasks
and a run may be cleared and rerun:

* files are written once (:func:`write_once`): a retried step finds its record
  and returns it, so the configuration version, the validation verdict and
  the decision of a run never change once taken;
* a step that stores versions reserves them first (:func:`reserve_versions`: the
  first new version and its parent, in a record of the run's written before
  anything is stored), so a try that dies between storing a version and
  recording it leaves the retry that version to store again, not a newer
  one: no orphan version, unvalidated, is left in the store;
* configurations are saved with :func:`keyplane.routing.config.save`, a no-op for an
  identical version, so the retry's save of its reserved version is one;
* a run's records are its DAG's: Airflow's run ids are unique per DAG only,
  and both DAGs can have a run of the same id (:func:`run_folder`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from keyplane.algorithms import statistics as stats
from keyplane.orchestration import planning
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig

log = logging.getLogger(__name__)

PROPOSAL = "proposal.json"
ALLOCATION = "allocation.json"
ROLLBACK_ALLOCATION = "rollback_allocation.json"
BACKTEST = "backtest.json"
DECISION = "decision.json"
ROLLOUT = "rollout.json"
VERIFICATION = "verification.json"
ROLLBACK = "rollback.json"
SCALE_DECISION = "scale_decision.json"
SCALE_PROPOSAL = "scale_proposal.json"
SCALE_COUNTS = "scale_counts.json"
"""The records of a ``keyplane_scale`` run (:mod:`keyplane.orchestration.scale_steps`),
named here with the other runs' records so that this module need not import that one."""
APPROVAL = "approval.json"

RECONFIGURE_DAG_ID = "keyplane_reconfigure"
SCALE_DAG_ID = "keyplane_scale"


class StepError(RuntimeError):
    """A step cannot run: an earlier step's record is missing or says no."""


class Refused(StepError):
    """A step refuses for a reason no retry can change: a Param the job cannot take, a
    failed validation, a decision not to publish, a stale plan. The DAGs fail the task
    at once, without retries (:func:`keyplane.orchestration.dagparts.fail_fast`)."""


def write_once(path: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``record`` as JSON unless ``path`` exists; return what the file holds."""
    if path.is_file():
        return dict(json.loads(path.read_text()))
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    staging.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    try:
        os.link(staging, path)
    except FileExistsError:
        pass
    finally:
        staging.unlink(missing_ok=True)
    return dict(json.loads(path.read_text()))


def read_record(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise StepError(f"{what} is missing ({path}); run the step that writes it first")
    return dict(json.loads(path.read_text()))


def snapshot(deployment: Deployment, run_id: str) -> stats.Snapshot:
    return stats.read_snapshot(deployment.snapshots, run_id)


def scale_folder(deployment: Deployment, run_id: str) -> Path:
    """The records of a ``keyplane_scale`` run, which takes no statistics snapshot."""
    return deployment.home / "scale" / stats.safe_run_id(run_id)


def reconfigure_folder(deployment: Deployment, run_id: str) -> Path:
    folder = stats.snapshot_folder(deployment.snapshots, run_id)
    if not (folder / stats.MANIFEST_NAME).is_file():
        raise StepError(f"no statistics snapshot for run {run_id!r} in {folder}")
    return folder


def run_folder(deployment: Deployment, dag_id: str, run_id: str) -> Path:
    """The folder of the records of ``dag_id``'s run ``run_id``.

    A reconfiguration run keeps them in its statistics snapshot, a scale
    run in :func:`scale_folder`. The DAG must be named: Airflow makes a run
    id unique within its DAG only, and a run id chosen by hand (the REST
    API, ``airflow dags trigger -r``) or an ``airflow dags test`` of the
    same logical date gives both DAGs a run of the same id, whose records
    are not each other's.
    """
    if dag_id == RECONFIGURE_DAG_ID:
        return stats.snapshot_folder(deployment.snapshots, run_id)
    if dag_id == SCALE_DAG_ID:
        return scale_folder(deployment, run_id)
    raise StepError(
        f"DAG {dag_id!r} keeps no keyplane run records "
        f"(only {RECONFIGURE_DAG_ID} and {SCALE_DAG_ID} do)"
    )


def reserve_versions(
    path: Path,
    deployment: Deployment,
    parent: int,
    *,
    version: int | None = None,
    **inputs: Any,
) -> dict[str, Any]:
    """The run's first new version and its parent, reserved once in ``path``.

    Written before the step stores anything, so that every try of the step stores the same versions:
    a try that died after storing a version and before recording it in the step's own record
    (``proposal.json``, ``rollback.json``) left that version, and the retry, planning with the
    reserved numbers and ``inputs`` (what the plan needs that could change between tries), stores it
    again, a no-op. ``version`` defaults to the store's newest + 1. The reservation is the run's
    alone: another process may still store that version meanwhile, and then :func:`store_version`
    refuses rather than overwrite it. The step's own record, which
    :func:`~keyplane.orchestration.rollout_steps.run_versions` reads to ABORT the run's versions, is
    written only once they are stored, so it never names another's.
    """
    if version is None:
        version = (config_store.latest_version(deployment.routing_store) or parent) + 1
    return write_once(path, {"parent_version": parent, "version": version, **inputs})


def store_version(deployment: Deployment, config: RoutingConfig) -> config_store.SavedConfig:
    """Save a version the run reserved (:func:`reserve_versions`); a no-op for the retry's save.

    Another configuration stored under the version meanwhile (another run,
    ``keyplane config publish``) is left as it is: the step fails naming
    it rather than overwrite a version that may be in flight already.
    """
    try:
        return config_store.save(config, deployment.routing_store)
    except config_store.VersionConflictError:
        raise Refused(
            f"v{config.version}, which this run reserved, was stored meanwhile with another "
            "routing (by another run or `keyplane config publish`); it is left as it is and "
            "this run stores and publishes nothing: the next run plans from the store as it is"
        ) from None


class Proposal(BaseModel):
    """What :func:`~keyplane.orchestration.configuration_steps.compute_configuration`
    decided for a run; the later steps read it.

    ``version`` routes as the plan. ``waves`` are the versions rolled out
    before it, in order, when the run splits its moves into waves
    (:mod:`keyplane.routing.waves`); each is the parent of the next, the first a
    child of ``parent_version`` and the last the parent of ``version``.
    ``candidate`` is the one the planner chose, ``promised_imbalance`` the
    next-window imbalance it promised (None: no promise) and ``model_promise``
    the drift model's bound behind it (0: none), which the verification
    compares with the measured imbalance (:func:`promise_ratios`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    parent_version: int
    checksum: str
    alpha: float
    window: planning.HistoryWindow
    table_budget: int | None
    predicted_locality: float
    current_locality: float
    predicted_imbalance: dict[str, float]
    hot_keys: dict[str, int]
    table_sizes: dict[str, int]
    waves: tuple[int, ...] = ()
    candidate: planning.Candidate | None = None
    promised_imbalance: float | None = None
    model_promise: float = 0.0


def read_proposal(deployment: Deployment, run_id: str) -> tuple[Proposal, RoutingConfig]:
    record = read_record(reconfigure_folder(deployment, run_id) / PROPOSAL, "the proposal")
    proposal = Proposal.model_validate(record)
    config = config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
    return proposal, config


def validation_path(deployment: Deployment, version: int) -> Path:
    return deployment.routing_store / f"validation-v{version:06d}.json"


def promise_ratios(deployment: Deployment, limit: int | None = None) -> tuple[float, ...]:
    """How earlier rollouts' promises fared, oldest first (by version): each
    verification's ``promise_ratio``, the measured imbalance's excess over 1 in
    units of the model promise's (:func:`keyplane.algorithms.plan_choice.promise_ratio`).

    The planner calibrates its next promise on them. They only widen or
    narrow a promise, so a record that cannot be read is left out and logged,
    never a reason to fail the run; with none there is no calibration. At
    most the last ``limit`` are returned (None: all).
    """
    root = deployment.snapshots
    found: list[tuple[int, float]] = []
    try:
        paths = sorted(root.glob(f"*/{VERIFICATION}")) if root.is_dir() else []
    except OSError as exc:
        log.warning("no promise calibration: cannot list %s (%s)", root, exc)
        return ()
    for path in paths:
        try:
            record = json.loads(path.read_text())
            ratio = record.get("promise_ratio")
            if ratio is None:
                continue
            version, value = int(record["version"]), float(ratio)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"promise_ratio {ratio!r} is not a finite ratio ≥ 0")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("left out of the promise calibration: %s (%s)", path, exc)
            continue
        found.append((version, value))
    found.sort()
    kept = found if limit is None else found[-limit:] if limit > 0 else []
    return tuple(value for _, value in kept)

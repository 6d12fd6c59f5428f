"""The steps of the scale DAG, one plain function each (paper 003, Stela).

Like the reconfiguration DAG's steps, every step takes the
:class:`~keyplane.orchestration.deployment.Deployment` and the run's id,
writes its record once into the run's folder (``$KEYPLANE_HOME/scale/<run>``,
:func:`keyplane.orchestration.run_records.scale_folder`) and returns it, so a
retried or cleared task finds the decision and the version its run already
took. The rollout itself (PREPARE, PROPAGATE, DONE and the deferred waits) is
the reconfiguration DAG's, unchanged: a scaled configuration is just another
version (000 §3.4), whose state moves go through the same hand-off.

The decision is :func:`keyplane.algorithms.scaling.decide_scaling`'s, on the newest
batches of the metrics topic and the times their records arrived there. The
scaled routing needs every key that holds state
(:func:`keyplane.algorithms.scaling.scaled_routing`: the job only moves the state of keys
a configuration names), so :func:`compute_scaled_configuration` counts the
keys of the pipeline's topics, from their earliest retained records: the job's state
holds exactly the keys of the events it counted. A run counts once, over the
offsets as they were when it counted, and keeps the counts in its folder
(:func:`run_counts`); the validation reads them there.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError, model_validator

from keyplane.algorithms.batchmetrics import BatchMetrics
from keyplane.algorithms.scaling import ScaleRequest, decide_scaling
from keyplane.algorithms.statistics import TopicWindow
from keyplane.orchestration import (
    configuration_steps,
    decision_steps,
    planning,
    rollout_steps,
    run_records,
    verification_steps,
)
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.util.statefiles import os_reason
from keyplane.util.validation_errors import first_problem

log = logging.getLogger(__name__)

DECISION = run_records.SCALE_DECISION
PROPOSAL = run_records.SCALE_PROPOSAL
METRICS_LOOKBACK = 4
"""Records read per batch of the window: room for batches on an older version."""


def _folder(deployment: Deployment, run_id: str) -> Path:
    folder = run_records.scale_folder(deployment, run_id)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def recent_metrics(deployment: Deployment, batches: int) -> list[tuple[BatchMetrics, float]]:
    """The newest metrics records (about ``METRICS_LOOKBACK × batches``), oldest first,
    each with the time it reached the topic (:func:`verification_steps.read_timed_metrics`)."""
    end = rollout_steps.metrics_end(deployment)
    start = {p: max(0, o - METRICS_LOOKBACK * (batches + 1)) for p, o in end.items()}
    records = verification_steps.read_timed_metrics(deployment, start, end)
    return sorted(records, key=lambda item: item[0].batch_id)


def decide(
    deployment: Deployment, run_id: str, request: ScaleRequest, *, dry_run: bool
) -> dict[str, Any]:
    """Stela's decision on the active version's newest batches (003 §4–5).

    Only batches routed entirely on the active version count: a window that
    spans a rollout would mix two layouts. A dry run records the decision and
    never publishes.
    """
    folder = _folder(deployment, run_id)
    existing = folder / DECISION
    if existing.is_file():
        return run_records.read_record(existing, "the scale decision")
    parent = configuration_steps.active_version(deployment, None)
    current = config_store.load(deployment.routing_store, parent)
    stages = deployment.operators
    if request.operator is not None and request.operator not in stages:
        raise run_records.Refused(
            f"operator {request.operator!r} is not a stage of the pipeline; its stages are "
            f"{', '.join(stages)}"
        )
    missing = [name for name in stages if name not in current.operators]
    if missing:
        raise run_records.Refused(
            f"v{parent} routes no stage {', '.join(missing)} of the pipeline "
            f"({deployment.pipeline}); it routes {', '.join(current.operators)}"
        )
    parallelism = {name: current.operators[name].parallelism for name in stages}
    if len(set(parallelism.values())) != 1:
        raise run_records.Refused(f"operators have different state partitions: {parallelism}")
    partitions = parallelism[stages[0]]
    if request.instances is not None and request.instances > partitions:
        raise run_records.Refused(
            f"instances {request.instances} is more than the job's {partitions} state "
            f"partitions (fixed when the job started); give at most {partitions}"
        )
    timed = [
        (r, reported)
        for r, reported in recent_metrics(deployment, request.congestion.window)
        if r.versions and set(r.versions.values()) == {parent}
    ]
    active = {name: current.operators[name].active for name in stages}
    decision = decide_scaling(
        [r for r, _ in timed],
        active,
        partitions,
        request,
        reported_at_s=[reported for _, reported in timed],
    )
    publish = decision.action != "none" and not dry_run
    reason = f"dry run: {decision.reason}" if dry_run else decision.reason
    record = {
        **decision.to_record(),
        "reason": reason,
        "parent_version": parent,
        "publish": publish,
    }
    record = run_records.write_once(existing, record)
    log.info("scale decision: %s", record["reason"])
    return record


COUNTS = run_records.SCALE_COUNTS


class EventCounts(BaseModel):
    """The events of the pipeline's topics in one window of offsets, counted once per run.

    ``loads`` holds the events per key of each stage, ``pairs`` the events per
    key of a stage and the next stage's key (``pairs[stage][key][next key]``):
    the pairs whose co-location is locality (000 §2). The run's first step
    that needs them counts and stores them (:func:`run_counts`); the later
    steps read them, so that the validation judges the loads the scaled
    version was planned from, not a topic that has grown since.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    windows: tuple[TopicWindow, ...]
    """The offsets ``[start, end)`` of every partition counted."""
    loads: dict[str, dict[str, NonNegativeInt]]
    pairs: dict[str, dict[str, dict[str, NonNegativeInt]]]

    @model_validator(mode="after")
    def _pairs_add_up_to_loads(self) -> EventCounts:
        """Every counted event of a stage that has a next stage makes one pair, so a
        stage's pairs of a key add up to its load: a file that was cut or edited is
        refused rather than read as other counts."""
        for stage, firsts in self.pairs.items():
            loads = self.loads.get(stage)
            if loads is None:
                raise ValueError(f"pairs of stage {stage!r}, which has no loads")
            for key, load in loads.items():
                paired = sum(firsts.get(key, {}).values())
                if paired != load:
                    raise ValueError(
                        f"stage {stage!r} key {key!r}: {load} events but {paired} in pairs"
                    )
            stray = sorted(set(firsts) - set(loads))
            if stray:
                raise ValueError(f"stage {stage!r} has pairs of keys with no load: {stray[:3]}")
        return self

    @property
    def events(self) -> int:
        """The events counted in the first stage (every counted event has one key there)."""
        return sum(next(iter(self.loads.values()), {}).values())

    def key_loads(self) -> dict[str, dict[str, float]]:
        """Tuples per key of each stage."""
        return {
            stage: {key: float(n) for key, n in keys.items()} for stage, keys in self.loads.items()
        }

    def pair_counts(self) -> dict[tuple[str, str, str], float]:
        """Tuples per ``(stage, its key, the next stage's key)``."""
        return {
            (stage, key, following): float(n)
            for stage, firsts in self.pairs.items()
            for key, nexts in firsts.items()
            for following, n in nexts.items()
        }


def count_events(deployment: Deployment) -> EventCounts:
    """Count the events of the pipeline's topics, from the earliest retained record to the
    high watermark as they are now (the window the counts record).

    The events are parsed and keyed as the job parses and keys them
    (:mod:`keyplane.orchestration.stage_keys`), so a key counts exactly when
    the job would have counted it. The count runs in the active Spark session,
    else in one of its own on ``KEYPLANE_SPARK_MASTER`` (the deployment's
    master for batch work, never the streaming job's session), started light:
    no UI and one shuffle partition, since the counts are one small row per
    pair of keys.
    """
    from pyspark.sql import SparkSession

    from keyplane.kafka.admin import earliest_offsets, high_watermarks
    from keyplane.orchestration.stage_keys import window_key_counts
    from keyplane.pipeline import load_pipeline
    from keyplane.settings import Settings
    from keyplane.spark.session import build_session

    pipeline = load_pipeline(deployment.pipeline)
    servers = deployment.bootstrap_servers
    windows = tuple(
        TopicWindow(
            topic=topic, start=earliest_offsets(servers, topic), end=high_watermarks(servers, topic)
        )
        for topic in pipeline.source.topics
    )
    active = SparkSession.getActiveSession()
    spark = active or build_session(
        "keyplane-scale-keys",
        Settings().spark_master,
        shuffle_partitions=1,
        extra={"spark.ui.enabled": "false"},
    )
    try:
        rows = window_key_counts(
            spark, servers, windows, pipeline, 0.0, deployment.max_event_bytes
        ).collect()
    finally:
        if active is None:
            spark.stop()
    loads: dict[str, dict[str, int]] = {name: {} for name in pipeline.stage_names}
    pairs: dict[str, dict[str, dict[str, int]]] = {}
    for row in rows:
        if row.stage is None:
            continue
        n = int(row.n)
        stage_loads = loads[row.stage]
        stage_loads[row.a] = stage_loads.get(row.a, 0) + n
        if row.b is not None:
            nexts = pairs.setdefault(row.stage, {}).setdefault(row.a, {})
            nexts[row.b] = nexts.get(row.b, 0) + n
    return EventCounts(windows=windows, loads=loads, pairs=pairs)


def _reason(error: OSError | ValueError) -> str:
    """Why a counts file could not be read, in one line."""
    if isinstance(error, ValidationError):
        return first_problem(error, "file")
    if isinstance(error, OSError | UnicodeDecodeError):
        return os_reason(error)
    return str(error)


def _window_text(counts: EventCounts) -> str:
    return "; ".join(
        f"{w.topic} {', '.join(f'p{p} [{w.start.get(p, 0)}, {end})' for p, end in w.end.items())}"
        for w in counts.windows
    )


def run_counts(deployment: Deployment, run_id: str, *, stored: bool = False) -> EventCounts:
    """The run's :class:`EventCounts`: those an earlier step stored (``scale_counts.json``
    in the run's folder), else counted now (:func:`count_events`) and stored.

    ``stored`` says the step expects an earlier step's counts (it judges what
    that step planned). A step that finds none, or a file it cannot read
    (which it sets aside as ``scale_counts.json.unreadable-<id>``, losing
    nothing), counts again and says so in its log, with the window it
    counted: the counts then include events newer than those the plan was
    made from.
    """
    path = _folder(deployment, run_id) / COUNTS
    if path.is_file():
        try:
            counts = EventCounts.model_validate_json(path.read_text())
        except (OSError, ValueError) as error:
            aside = path.with_name(f"{path.name}.unreadable-{uuid.uuid4().hex[:8]}")
            path.replace(aside)
            log.warning(
                "the run's event counts %s cannot be read (%s); kept as %s, counting again",
                path,
                _reason(error),
                aside.name,
            )
        else:
            log.info(
                "read the run's event counts from %s: %d events in %s",
                path,
                counts.events,
                _window_text(counts),
            )
            return counts
    elif stored:
        log.warning(
            "the run's event counts %s are missing (the step that stores them has not run, or "
            "its file was removed); counting again, over events newer than the plan's",
            path,
        )
    record = run_records.write_once(path, count_events(deployment).model_dump(mode="json"))
    counts = EventCounts.model_validate(record)
    log.info("counted %d events in %s; stored in %s", counts.events, _window_text(counts), path)
    return counts


def predicted_locality(
    config: RoutingConfig, pairs: dict[tuple[str, str, str], float], stages: Sequence[str]
) -> float:
    """The share of the tuples between consecutive stages that ``config`` keeps on one
    instance (000 §3.2)."""
    import pandas as pd

    if not pairs:
        return 0.0
    frame = pd.DataFrame(list(pairs), columns=["stage", "a", "b"])
    weights = pd.Series(list(pairs.values()), dtype="float64")
    return planning.locality(config, frame, weights, stages)


class ScaleProposal(BaseModel):
    """The scaled version a run stored; the later steps read it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    parent_version: int
    checksum: str
    operator: str
    active_before: list[int]
    active_after: list[int]
    keys: int
    tabled: int
    run_id: str | None = None
    """The Airflow run that stored the version (None in records written before it was kept)."""
    reason: str | None = None
    """The decision's reason: why the operator was scaled."""
    locality_before: float | None = None
    """Predicted share of the tuples between consecutive stages on one instance on the
    parent version (000 §3.2)."""
    locality_after: float | None = None
    """The same on the scaled version: a scale-in folds keys onto fewer instances and
    usually separates pairs the parent kept together."""


def compute_scaled_configuration(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """Store the active version with the decided operator over its new active instances.

    :func:`keyplane.algorithms.scaling.scaled_routing` keeps every key whose instance
    stays active and moves the others; the other operator keeps its routing.
    The version, its parent and the key loads it is planned from are
    reserved in the run's folder before it is stored
    (:func:`keyplane.orchestration.run_records.reserve_versions`): the events topic grows
    between tries, and a retry that counted it again would plan another
    table under another version, leaving the first try's stored and
    unvalidated. Retried, the step plans from the same loads and stores
    the same version, a no-op.
    """
    from keyplane.algorithms.scaling import scaled_routing

    folder = _folder(deployment, run_id)
    existing = folder / PROPOSAL
    if existing.is_file():
        proposal = ScaleProposal.model_validate_json(existing.read_text())
        config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
        return proposal.model_dump(mode="json")
    decision = run_records.read_record(folder / DECISION, "the scale decision")
    if not decision["publish"]:
        raise run_records.Refused(f"the decision was not to scale: {decision['reason']}")
    operator = str(decision["operator"])
    counts = run_counts(deployment, run_id)
    allocation = folder / run_records.ALLOCATION
    if allocation.is_file():
        reserved = run_records.read_record(allocation, "the reservation")
    else:
        reserved = run_records.reserve_versions(
            allocation,
            deployment,
            int(decision["parent_version"]),
            key_loads=counts.key_loads()[operator],
        )
    parent = int(reserved["parent_version"])
    loads: dict[str, float] = reserved["key_loads"]
    current = config_store.load(deployment.routing_store, parent)
    routing = scaled_routing(current.operators[operator], decision["active_after"][operator], loads)
    config = RoutingConfig(
        version=int(reserved["version"]),
        parent_version=parent,
        created_by="scale",
        operators={**current.operators, operator: routing},
    )
    saved = run_records.store_version(deployment, config)
    pairs = counts.pair_counts()
    stages = deployment.operators
    before = predicted_locality(current, pairs, stages)
    after = predicted_locality(config, pairs, stages)
    proposal = ScaleProposal(
        version=saved.version,
        parent_version=parent,
        checksum=saved.checksum,
        operator=operator,
        active_before=list(decision["active_before"][operator]),
        active_after=list(routing.active),
        keys=len(loads),
        tabled=len(routing.table),
        run_id=run_id,
        reason=str(decision["reason"]),
        locality_before=before,
        locality_after=after,
    )
    record = run_records.write_once(existing, proposal.model_dump(mode="json"))
    log.info(
        "stored v%d: %s over instances %s (was %s), %d keys tabled; predicted locality "
        "%.1f%% → %.1f%%",
        saved.version,
        operator,
        list(routing.active),
        proposal.active_before,
        proposal.tabled,
        100 * before,
        100 * after,
    )
    return record


def validate_scaled_configuration(
    deployment: Deployment, run_id: str, *, alpha: float
) -> dict[str, Any]:
    """Run the configuration suites of :mod:`keyplane.orchestration.quality` on the scaled version.

    Only the operators the scale changed are judged (the others keep the
    routing that runs now). A scaled operator is judged on its active
    instances: the suites see it as
    an operator of ``len(active)`` instances (renumbered in order) in which
    every key of the events topic is tabled where the job will route it, so
    "max/mean within α" compares the active instances only and an idle
    released instance does not count as imbalance. The verdict is recorded
    where :func:`keyplane.orchestration.rollout_steps.publish_version` requires it.
    """
    from keyplane.algorithms.scaling import active_view
    from keyplane.orchestration.quality import OperatorPrediction, QualitySettings, locked_context
    from keyplane.orchestration.quality import validate_configuration as run_suites

    folder = _folder(deployment, run_id)
    proposal = ScaleProposal.model_validate(
        run_records.read_record(folder / PROPOSAL, "the scale proposal")
    )
    config = config_store.load(deployment.routing_store, proposal.version, proposal.checksum)
    parent = config_store.load(deployment.routing_store, proposal.parent_version)
    loads = run_counts(deployment, run_id, stored=True).key_loads()
    changed = configuration_steps.changed_operators(config, parent)
    view = changed.model_copy(
        update={
            "operators": {
                name: active_view(routing, loads[name])
                for name, routing in changed.operators.items()
            }
        }
    )
    predictions = {
        name: OperatorPrediction(
            predicted_imbalance=planning.imbalance(planning.instance_loads(routing, loads[name])),
            predicted_locality=0.0,
            current_locality=0.0,
            alpha=alpha,
            key_loads=loads[name],
        )
        for name, routing in view.operators.items()
    }
    with locked_context(deployment.gx_root) as context:
        result = run_suites(
            view,
            predictions,
            context=context,
            settings=QualitySettings(),
            run_name=f"configuration-v{config.version}",
        )
    log.info("configuration validation of scaled v%d:\n%s", config.version, result.summary)
    record = configuration_steps.record_validation(
        deployment, config.version, result.success, result.summary, result.data_docs_path
    )
    if not record["success"]:
        decision_steps.not_published(deployment, [config.version], "failed validation", run_id)
        raise run_records.Refused(
            f"v{config.version} failed validation and will not be published:\n{record['summary']}"
        )
    log.info("scaled v%d passed validation", config.version)
    return record


def publish(deployment: Deployment, run_id: str) -> dict[str, Any]:
    """PREPARE the scaled version (000 §3.4), once validated and decided."""
    folder = _folder(deployment, run_id)
    proposal = run_records.read_record(folder / PROPOSAL, "the scale proposal")
    return rollout_steps.publish_version(
        deployment, int(proposal["version"]), int(proposal["parent_version"])
    )


def done(deployment: Deployment, run_id: str, version: int | None = None) -> dict[str, Any]:
    """DONE: the scaled version becomes active; its metrics start here.

    ``version`` as for :func:`keyplane.orchestration.rollout_steps.propagate`.
    """
    return rollout_steps.done_into(
        deployment, _folder(deployment, run_id) / run_records.ROLLOUT, version
    )


def verify(deployment: Deployment, run_id: str, *, batches: int) -> dict[str, Any]:
    """The first ``batches`` batches on the scaled version used active instances only.

    Read from the job's own metrics: every instance that processed a tuple
    must be active in the scaled version, for both operators.
    """
    folder = _folder(deployment, run_id)
    existing = folder / run_records.VERIFICATION
    if existing.is_file():
        return run_records.read_record(existing, "the verification")
    rollout = run_records.read_record(folder / run_records.ROLLOUT, "the rollout record")
    version = int(rollout["version"])
    config = config_store.load(deployment.routing_store, version)
    start = {int(p): int(o) for p, o in rollout["metrics_start"].items()}
    after = [
        r
        for r in verification_steps.read_metrics(deployment, start)
        if r.hops > 0 and r.versions and set(r.versions.values()) == {version}
    ][:batches]
    if len(after) < batches:
        raise run_records.StepError(f"only {len(after)} of {batches} batches ran on v{version} yet")
    stages = deployment.operators
    busy: dict[str, set[int]] = {name: set() for name in stages}
    for batch in after:
        for name in stages:
            busy[name] |= {int(i) for i, n in batch.load.get(name, {}).items() if n > 0}
    stray = {
        name: sorted(busy[name] - set(config.operators[name].active))
        for name in stages
        if busy[name] - set(config.operators[name].active)
    }
    record = run_records.write_once(
        existing,
        {
            "version": version,
            "batches": len(after),
            "busy_instances": {name: sorted(found) for name, found in busy.items()},
            "active_instances": {name: list(config.operators[name].active) for name in stages},
            "stray": stray,
            "ok": not stray,
        },
    )
    if not record["ok"]:
        raise run_records.Refused(
            f"v{version} routed tuples to inactive instances: {record['stray']}"
        )
    log.info(
        "verified v%d over %d batches: busy instances %s, all active",
        version,
        record["batches"],
        "; ".join(f"{name} {found}" for name, found in record["busy_instances"].items()),
    )
    return record


EXECUTORS = "executors.json"
"""The run's executor change: the executors before and after, and how long it took."""


def change_executors(
    deployment: Deployment,
    run_id: str,
    *,
    when: Literal["out", "in"],
    enabled: bool,
    wait_s: float,
) -> dict[str, Any]:
    """Add an executor before a scale-out grows its stage, or release one after a scale-in.

    Stela gives a scale-out a new machine before it moves instances onto it,
    and takes a machine away only once its instances are drained (003 §5).
    The job's driver does it (:mod:`keyplane.spark.executors`); this step
    sends the command and waits for its answer, which names the executors
    the driver saw before and after. A step whose decision is the other
    action (or no action), or a run with ``enabled`` off (the ``executors``
    Param), changes nothing. Which executor a
    scale-in releases is the driver's choice: the newest
    (:func:`keyplane.spark.executors.to_release`).

    Every try of the step sends the same command, whose id is the run's and
    the action's (:func:`keyplane.spark.executors.command_id`), and sends it
    only if the topic holds no reply to it yet: a try retried after the
    driver answered, but before ``executors.json`` was written, records that
    answer and changes nothing more.
    """
    from keyplane.spark.executors import (
        ExecutorChannel,
        ExecutorCommand,
        command_id,
        executors_topic,
        request,
    )

    if not enabled:
        return {"changed": None, "skipped": "executors off"}
    folder = _folder(deployment, run_id)
    existing = folder / EXECUTORS
    if existing.is_file():
        return run_records.read_record(existing, "the executor change")
    decision_file = folder / DECISION
    decision = run_records.read_record(decision_file, "the scale decision")
    if decision["action"] != when or not decision["publish"]:
        return {"changed": None, "skipped": f"the decision is {decision['action']!r}"}
    action: Literal["add", "release"] = "add" if when == "out" else "release"
    topic = executors_topic(deployment.control_topic)
    channel = ExecutorChannel(deployment.bootstrap_servers, topic)
    command = ExecutorCommand(
        action=action, wait_s=wait_s, request_id=command_id(topic, run_id, action)
    )
    try:
        channel.ensure()
        reply = request(channel, command, wait_s + 60.0)
    finally:
        channel.close()
    if reply.outcome != "applied":
        raise run_records.Refused(f"the job did not {action} an executor: {reply.reason}")
    record = run_records.write_once(
        existing,
        {
            "action": action,
            "executor": reply.changed,
            "executors_before": list(reply.before),
            "executors_after": list(reply.after),
            "driver_seconds": reply.seconds,
            # The decision record's write time is the decision's.
            "seconds_from_decision": round(time.time() - decision_file.stat().st_mtime, 3),
        },
    )
    log.info(
        "executor %s %s: %d → %d executors, %.1f s after the decision",
        record["executor"],
        "added" if action == "add" else "released",
        len(reply.before),
        len(reply.after),
        record["seconds_from_decision"],
    )
    return record

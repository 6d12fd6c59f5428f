"""``keyplane``: the command line of the control plane.

Every long step shows a progress bar; every failure exits non-zero with one
line that says what went wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import typing
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from kafka.errors import KafkaError
from pydantic import BaseModel, ValidationError
from tqdm import tqdm

from keyplane.aggregates import AggregateSpecError
from keyplane.control.controller import (
    Controller,
    ControllerError,
    ControllerFile,
    RolloutProgress,
    RolloutTimeout,
    read_controller_file,
)
from keyplane.control.messages import ProtocolError
from keyplane.control.operators import stage_names
from keyplane.control.signing import MissingKeyError, control_key
from keyplane.kafka.admin import TopicError, check_topic_name, ensure_topic, high_watermarks
from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import BrokerError, BrokerState, EmbeddedBroker, answers_kafka
from keyplane.kafka.control import ControlChannel
from keyplane.kafka.producer import WorkloadNotDelivered, produce_workload
from keyplane.pipeline import PipelineError
from keyplane.reference.events import FORWARD_MODES, MAX_EVENT_BYTES
from keyplane.reference.workloads import GeoTagsWorkload, PairsWorkload, ZipfEvolvingWorkload
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.routing.config_report import render_config, render_diff
from keyplane.routing.routedkeys import spark_partition
from keyplane.routing.waves import split_into_waves
from keyplane.settings import STAGE_ENGINES, Settings
from keyplane.spark.jobprocess import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    JobError,
    JobProcess,
    JobStatus,
    describe_aggregates,
    read_metrics_topic,
)
from keyplane.util.progressbars import progress_bar
from keyplane.util.statefiles import os_reason
from keyplane.util.validation_errors import first_problem

WORKLOADS: dict[str, type[BaseModel]] = {
    "pairs": PairsWorkload,
    "zipf-evolving": ZipfEvolvingWorkload,
    "geo-tags": GeoTagsWorkload,
}


class CliError(RuntimeError):
    """A user-facing error: printed as one line, exit status 2."""


def _add_model_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One ``--option`` per field of a workload spec, with its description.

    An option not given is left out of the namespace (``SUPPRESS``), so that
    the spec's own default applies and ``none`` given to an optional integer
    (``--flash-every none``) can still reach the spec as None.
    """
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        default = field.default
        bounds = "".join(f", at most {m.le:,}" for m in field.metadata if hasattr(m, "le"))
        help_text = f"{field.description or ''} (default: {default}{bounds})"
        unset = argparse.SUPPRESS
        if origin is tuple:
            parser.add_argument(
                flag, dest=name, type=float, nargs="+", default=unset, help=help_text
            )
        elif annotation is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=unset,
                help=help_text,
            )
        else:
            scalar = args[0] if args else annotation
            convert: Callable[[str], Any] = str
            if scalar is int:
                convert = _int_or_none if type(None) in typing.get_args(annotation) else int
            elif scalar is float:
                convert = float
            parser.add_argument(flag, dest=name, type=convert, default=unset, help=help_text)


def _int_or_none(text: str) -> int | None:
    """An argparse type for an optional integer field: ``none`` (any case) is None."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'none'") from None


def _spec_from_args(kind: str, args: argparse.Namespace) -> Any:
    model = WORKLOADS[kind]
    given = vars(args)
    values = {name: given[name] for name in model.model_fields if name != "kind" and name in given}
    return model(kind=kind, **values)


def _broker(settings: Settings, args: argparse.Namespace) -> EmbeddedBroker | ApacheKafkaBroker:
    port = settings.broker_port if args.port is None else args.port
    if (args.engine or settings.broker_engine) == "kafka":
        if args.storage is not None:
            raise BrokerError(
                "--storage is the embedded broker's; Apache Kafka keeps its records in "
                "log directories under KEYPLANE_HOME/kafka"
            )
        return ApacheKafkaBroker(settings.home, port)
    return EmbeddedBroker(
        settings.home,
        port,
        storage=args.storage or settings.broker_storage,
        bucket=settings.broker_bucket,
    )


MEMORY_WARNING = (
    "warning: the broker's storage is memory: every topic and record is lost {when}, and a "
    "job's checkpoint is then ahead of its topics; use --storage s3 to keep them"
)


def _storage_line(state: BrokerState) -> str:
    if state.s3_endpoint is None:
        return f"storage {state.storage}"
    return f"storage {state.storage} at {state.s3_endpoint}"


def cmd_broker(settings: Settings, args: argparse.Namespace) -> int:
    broker = _broker(settings, args)
    running, stale = broker.inspect()
    for removed in stale:
        print(removed.describe())
    if args.action == "start":
        if isinstance(broker, EmbeddedBroker):
            state = broker.start(allow_memory=args.allow_memory)
        else:
            state = broker.start()
        print(
            f"broker running on {state.bootstrap_servers} (pid {state.pid}, "
            f"{_storage_line(state)}, log {state.log})"
        )
        if state.storage.startswith("memory"):
            print(MEMORY_WARNING.format(when="when this broker stops"), file=sys.stderr)
    elif args.action == "stop":
        print("broker stopped" if broker.stop() else "no broker was running")
        if running is not None and running.storage.startswith("memory"):
            print(MEMORY_WARNING.format(when="now"), file=sys.stderr)
    else:
        if running is None:
            address = f"127.0.0.1:{broker.port}"
            if answers_kafka(address, timeout_s=2.0):
                print(
                    f"broker: none started from KEYPLANE_HOME={settings.home}, but Kafka "
                    f"answers at {address} (a broker of another home, or not keyplane's)"
                )
                return 0
            print(f"broker: not running (none started from KEYPLANE_HOME={settings.home})")
            return 1
        print(
            f"broker: running on {running.bootstrap_servers} "
            f"(pid {running.pid}, {_storage_line(running)})"
        )
    return 0


def _ensure_topic(bootstrap: str, topic: str, partitions: int) -> int:
    """:func:`ensure_topic`, saying so when the topic exists with another partition count.

    The topic keeps its count (tansu cannot add partitions), so without a
    word the events would spread over partitions the user did not ask for.
    """
    n = ensure_topic(bootstrap, topic, partitions)
    if n != partitions:
        print(
            f"notice: topic {topic} already exists with {n} partitions, not {partitions}; "
            f"it keeps {n} (for {partitions}, delete it or choose another name)"
        )
    return n


def cmd_topic(settings: Settings, args: argparse.Namespace) -> int:
    bootstrap = settings.resolved_bootstrap_servers()
    if args.action == "create":
        n = _ensure_topic(bootstrap, args.name, args.partitions)
        print(f"topic {args.name}: {n} partitions")
    else:
        marks = high_watermarks(bootstrap, args.name)
        print(f"topic {args.name}: {sum(marks.values()):,} records in {len(marks)} partitions")
    return 0


def cmd_generate(settings: Settings, args: argparse.Namespace) -> int:
    spec = _spec_from_args(args.workload, args)
    topic = settings.events_topic if args.topic is None else args.topic
    bootstrap = settings.resolved_bootstrap_servers()
    n_parts = _ensure_topic(bootstrap, topic, args.partitions)
    with progress_bar(
        total=spec.n_events, desc=f"generate {args.workload}", unit="ev", unit_scale=True
    ) as bar:
        try:
            sent = produce_workload(
                spec,
                bootstrap,
                topic,
                partitions=args.partitions,
                topic_partitions=n_parts,
                rate=args.rate,
                on_progress=bar.update,
            )
        except WorkloadNotDelivered as exc:
            raise CliError(
                f"{exc}; see what the topic holds with `keyplane topic describe {topic}`"
            ) from None
    print(f"sent {sent:,} events to {topic}")
    return 0


def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from keyplane.demo import run_demo

    spec = _spec_from_args(args.workload, args)
    result = run_demo(
        spec,
        settings,
        rate=args.rate,
        partitions=args.partitions,
        max_offsets_per_trigger=args.max_offsets_per_trigger,
    )
    return 0 if result.succeeded else 1


def _config_store(settings: Settings, args: argparse.Namespace) -> tuple[Path, list[int]]:
    """The store to read and its versions, refusing an empty store up front: "no
    version 3" would send the user looking for a version when none was ever published."""
    store: Path = args.store or settings.config_store
    versions = config_store.stored_versions(store)
    if not versions:
        raise CliError(f"no configuration stored in {store}; publish one first")
    return store, versions


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "publish":
        return cmd_config_publish(settings, args)
    if args.action == "abort":
        return cmd_config_abort(settings, args)
    store, versions = _config_store(settings, args)
    if args.action == "list":
        return cmd_config_list(settings, store, versions, show_all=args.all)
    if args.action == "show":
        version = args.version or _active_version(settings, store, versions)
        shown = config_store.load(store, version)
        print(render_config(shown, config_store.checksum(store, version)))
        return 0
    old = config_store.load(store, args.a)
    new = config_store.load(store, args.b)
    if set(old.operators) != set(new.operators):
        raise CliError(
            f"versions {args.a} and {args.b} route different operators "
            f"({', '.join(old.operators)} vs {', '.join(new.operators)}); "
            "diff two versions of the same pipeline"
        )
    print(render_diff(old, new))
    print(_expected_gain(old, new, args.statistics or settings.home / "statistics"))
    return 0


def _active_version(settings: Settings, store: Path, versions: list[int]) -> int:
    """The version the job runs: the controller's active version once a rollout happened,
    else the newest stored version that was not marked as planned but not published."""
    saved = read_controller_file(settings.controller_state)
    if saved is not None:
        return saved.protocol.active_version
    skipped = config_store.not_published(store)
    candidates = [v for v in versions if v not in skipped]
    return candidates[-1] if candidates else versions[-1]


def cmd_config_list(settings: Settings, store: Path, versions: list[int], *, show_all: bool) -> int:
    """One line a version, newest first; versions planned but not published only with --all."""
    skipped = config_store.not_published(store)
    active = _active_version(settings, store, versions)
    hidden = 0
    for version in reversed(versions):
        if version in skipped and not show_all:
            hidden += 1
            continue
        config = config_store.load(store, version)
        parent = "-" if config.parent_version is None else f"v{config.parent_version}"
        if version == active:
            status = "active"
        elif version in skipped:
            status = f"not published: {skipped[version].get('reason', '?')}"
        else:
            status = "stored"
        print(
            f"v{version:<6} parent {parent:<7} {config.created_by:<9} "
            f"{config.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC  {status}"
        )
    if hidden:
        print(f"({hidden} versions planned but not published are hidden; --all lists them)")
    return 0


def _expected_gain(old: RoutingConfig, new: RoutingConfig, snapshots: Path) -> str:
    """Both versions scored on the newest statistics snapshot's hold-out, as the DAG's
    backtest scores them (paper 000 §4.3: a table is judged on the next window)."""
    from keyplane.algorithms import statistics
    from keyplane.orchestration.planning import backtest

    manifest = statistics.latest_snapshot(snapshots)
    if manifest is None:
        return f"expected gain: no statistics snapshot in {snapshots} (the DAG writes them)"
    snapshot = statistics.read_snapshot(snapshots, manifest.run_id)
    result = backtest(new, old, snapshot.pairs, snapshot.frequencies)
    return (
        f"expected on statistics {manifest.run_id} (hold-out of "
        f"{result.holdout_tuples:,.0f} tuples): locality {result.current.locality:.1%} → "
        f"{result.new.locality:.1%}, worst imbalance {result.current.worst_imbalance:.2f} → "
        f"{result.new.worst_imbalance:.2f}; the rollout moves {result.moved_share:.1%} of the state"
    )


def _read_config_file(path: Path) -> RoutingConfig:
    """The configuration in ``path``, or a one-line error naming the file and the field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {os_reason(exc)}") from None
    try:
        config = RoutingConfig.model_validate_json(text)
        json.loads(text, object_pairs_hook=_without_repeated_names)
    except ValueError as exc:
        problem = first_problem(exc) if isinstance(exc, ValidationError) else str(exc)
        raise CliError(f"{path} is not a valid routing configuration: {problem}") from None
    return config


def _without_repeated_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a name given twice: JSON parsers keep the last
    one without a word, so ``{"users": {...}, "users": {...}}`` would lose an operator's
    routing."""
    members: dict[str, Any] = {}
    for name, value in pairs:
        if name in members:
            raise ValueError(f"{name!r} is given twice in one object")
        members[name] = value
    return members


def _check_parent(config: RoutingConfig, store: Path, path: Path) -> None:
    """Refuse, before anything is stored, a child that cannot replace its parent.

    A stored version never changes, so a child stored with a missing parent
    or other operators would keep its version number unusable for good.
    """
    assert config.parent_version is not None
    try:
        parent = config_store.load(store, config.parent_version)
    except config_store.UnknownVersionError:
        raise CliError(
            f"{path} names parent_version {config.parent_version}, which {store} does not hold; "
            "publish the parent first, or name a stored version"
        ) from None
    try:
        config_store.check_same_operators(parent, config)
    except ValueError as exc:
        raise CliError(
            f"{path} cannot replace its parent v{config.parent_version}: {exc}"
        ) from None


def _check_against_the_pipeline(config: RoutingConfig, settings: Settings, path: Path) -> None:
    """Refuse, before anything is stored, a version that does not route exactly the stages
    of the pipeline the job runs (``KEYPLANE_PIPELINE``)."""
    try:
        stages = stage_names(settings.pipeline)
    except PipelineError as exc:
        raise CliError(f"cannot check {path} against the job's pipeline: {exc}") from None
    if set(config.operators) != set(stages):
        raise CliError(
            f"{path} routes operators {', '.join(sorted(config.operators))}, but the "
            f"pipeline {settings.pipeline} has stages {', '.join(stages)}; nothing was stored"
        )


def _check_against_the_job(config: RoutingConfig, settings: Settings, path: Path) -> None:
    """Refuse, before anything is stored or sent, a version the job in this home cannot take.

    The job checks every version itself, but only once PREPARE reaches it,
    after the version number is used for good; what it checks against is
    known here: whether it runs, its state partitions (fixed for the life of
    its checkpoint), its operators, and whether a signing key is set. A home
    with no job of its own and a metrics topic that a job writes to belongs
    to a job run elsewhere (a cluster's driver), which is left to check the
    version when PREPARE reaches it.
    """
    control_key()
    job = JobProcess(settings)
    record = job.running()
    if record is None:
        fix = (
            "start it with `keyplane job start` first (nothing was stored; for a job "
            "started elsewhere, pass --no-job-check)"
        )
        if job.directory.exists():
            raise CliError(f"no job runs in {settings.home} to take v{config.version}: {fix}")
        bootstrap = settings.resolved_bootstrap_servers()
        if read_metrics_topic(bootstrap, settings.metrics_topic, window=5) is None:
            raise CliError(
                f"no job runs in {settings.home}, and none has written to the metrics topic "
                f"{settings.metrics_topic!r} to take v{config.version}: {fix}"
            )
        # A job run elsewhere (a cluster's driver): it checks the version itself.
        return
    partitions = job.running_partitions(record)
    if partitions is None:
        return
    count, source = partitions
    for name, routing in sorted(config.operators.items()):
        if routing.parallelism != count:
            raise CliError(
                f"{path} routes {name} over {routing.parallelism} instances, but the job "
                f"(pid {record.pid}) runs {count} state partitions per operator ({source}); "
                f"plan the version for {count}, or restart the job on a new checkpoint; "
                "nothing was stored"
            )


def _already_active(config: RoutingConfig, settings: Settings) -> bool:
    """Whether the controller's last finished rollout made ``config``'s version the active
    one: publishing it again must change nothing, not send its protocol once more."""
    saved = read_controller_file(settings.controller_state)
    if saved is None:
        return False
    state = saved.protocol
    return state.current is None and state.active_version == config.version


def _check_storable(config: RoutingConfig, store: Path, path: Path) -> None:
    """Refuse ``config`` if ``store`` holds other contents under its version."""
    try:
        config_store.check_storable(config, store)
    except config_store.VersionConflictError:
        latest = config_store.latest_version(store)
        raise CliError(
            f"version {config.version} is already stored in {store} with different contents; "
            f"give {path} a new version (the latest stored is {latest})"
        ) from None


def _save_published(config: RoutingConfig, store: Path, path: Path) -> None:
    """Store ``config``; the same contents again are fine, different ones under its version not."""
    already = config_store.version_path(store, config.version).exists()
    _check_storable(config, store, path)
    saved = config_store.save(config, store)
    state = "already stored" if already else "stored"
    print(f"v{config.version} {state} in {store} (checksum {saved.checksum[:12]})")


def _controller(settings: Settings, channel: ControlChannel, store: Path) -> Controller:
    try:
        stages: tuple[str, ...] | None = stage_names(settings.pipeline)
    except PipelineError:
        stages = None  # the configurations' own order, upstream first
    return Controller(
        channel, settings.controller_state, store, stages, metrics_topic=settings.metrics_topic
    )


def _control_channel(settings: Settings) -> ControlChannel:
    return ControlChannel(settings.resolved_bootstrap_servers(), settings.control_topic)


class _StepDisplay:
    """One progress line for the step in flight, and one printed line per finished step."""

    def __init__(self) -> None:
        self._bar: tqdm[Any] | None = None

    def __call__(self, progress: RolloutProgress) -> None:
        if self._bar is None:
            self._bar = tqdm(
                total=progress.total,
                unit="step",
                leave=False,
                disable=None,
                bar_format="{desc} [{n_fmt}/{total_fmt} steps, {elapsed}]",
            )
        self._bar.set_description_str(progress.label, refresh=False)
        if progress.finished:
            self._bar.update(1)
            tqdm.write(f"{progress.label:<28} {progress.elapsed_s:7.2f} s")
        else:
            self._bar.refresh()

    def __enter__(self) -> _StepDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.close()


def cmd_config_publish(settings: Settings, args: argparse.Namespace) -> int:
    """Store FILE, then roll it out to the running job (paper 000 §3.4).

    Both halves can be repeated: storing the same contents again is a no-op,
    and the rollout resumes from the controller's state file, so after an
    interruption (or ``--no-wait``) the same command finishes the job.
    """
    # Records the controller cannot verify are counted into its errors; not also logged.
    logging.getLogger("keyplane.control.controller").setLevel(logging.ERROR)
    config = _read_config_file(args.file)
    store: Path = args.store or settings.config_store
    if args.max_moves_per_wave is not None and config.parent_version is not None:
        return _publish_in_waves(settings, args, config, store)
    if config.parent_version is not None:
        _check_parent(config, store, args.file)
    _check_against_the_pipeline(config, settings, args.file)
    if config.parent_version is not None:
        _check_storable(config, store, args.file)
        if not args.no_job_check:
            _check_against_the_job(config, settings, args.file)
        if _already_active(config, settings):
            _save_published(config, store, args.file)
            print(f"v{config.version} is already active; nothing to do")
            return 0
    _save_published(config, store, args.file)
    if config.parent_version is None:
        print(f"v{config.version} is an initial configuration: start the job on it")
        return 0
    with _control_channel(settings) as channel:
        controller = _controller(settings, channel, store)
        if args.no_wait:
            message = controller.prepare(config.version)
            print(
                f"sent {message.describe()}; run this command again without --no-wait "
                "to follow the rollout"
            )
            return 0
        try:
            with _StepDisplay() as display:
                result = controller.rollout(config.version, timeout_s=args.timeout, on_step=display)
        except RolloutTimeout as exc:
            print(f"keyplane: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if controller.in_flight != config.version:
                raise
            print(
                f"keyplane: interrupted; v{config.version} is still rolling out: run this "
                "command again to resume, or `keyplane config abort`",
                file=sys.stderr,
            )
            return 130
    print(f"v{result.version} is active (from v{result.previous_version}, {result.total_s:.2f} s)")
    return 0


def _publish_in_waves(
    settings: Settings, args: argparse.Namespace, config: RoutingConfig, store: Path
) -> int:
    """Store FILE's reconfiguration as waves of at most ``--max-moves-per-wave`` moved keys
    each (:mod:`keyplane.routing.waves`), numbered from FILE's version on, and roll them out
    in turn.

    Like a single version, both halves repeat safely: the waves are computed
    the same way again, and the rollout skips the waves the job already runs.
    """
    if args.no_wait:
        raise CliError("--no-wait sends one PREPARE; it cannot follow waves")
    base = _wave_base(config, store, read_controller_file(settings.controller_state))
    if base != config.parent_version:
        print(
            f"the job runs v{base}, not {args.file}'s parent v{config.parent_version}: "
            f"the waves start from v{base}"
        )
    try:
        waves = split_into_waves(
            config_store.load(store, base), config, spark_partition, args.max_moves_per_wave
        )
    except (config_store.ConfigStoreError, ValueError) as exc:
        raise CliError(f"cannot split {args.file} into waves: {exc}") from None
    _check_against_the_pipeline(config, settings, args.file)
    if not args.no_job_check:
        _check_against_the_job(config, settings, args.file)
    for wave in waves:
        _save_published(wave, store, args.file)
    versions = [wave.version for wave in waves]
    print(
        f"v{config.version} of {args.file} rolls out from v{base} in {len(waves)} wave(s): "
        f"v{versions[0]}..v{versions[-1]}, at most {args.max_moves_per_wave:,} moved keys each"
    )
    with _control_channel(settings) as channel:
        controller = _controller(settings, channel, store)
        try:
            with _StepDisplay() as display:
                results = controller.rollout_waves(
                    versions, timeout_s=args.timeout, on_step=display
                )
        except RolloutTimeout as exc:
            state = controller.state
            active = "" if state is None else f"; the job runs v{state.active_version}"
            print(f"keyplane: {exc}{active}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            in_flight = controller.in_flight
            if in_flight is None:
                raise
            print(
                f"keyplane: interrupted; wave v{in_flight} is still rolling out: run this "
                "command again to resume the waves, or `keyplane config abort`",
                file=sys.stderr,
            )
            return 130
    seconds = sum(result.total_s for result in results)
    print(f"v{versions[-1]} is active, routing as {args.file} ({seconds:.2f} s of rollouts)")
    return 0


def _wave_base(config: RoutingConfig, store: Path, saved: ControllerFile | None) -> int:
    """The version FILE's waves are planned from: the one the job runs.

    The waves' hand-offs are computed from the version the job runs, so
    planning from it sizes each wave by the moves still to do: after an
    aborted wave, FILE published again under a new version carries on from
    the last wave the job finished rather than re-planning moves already made.
    Once FILE's first wave is stored, its parent is the base, so the same
    command again computes the same waves and resumes them.
    """
    assert config.parent_version is not None
    if config_store.version_path(store, config.version).exists():
        stored = config_store.load(store, config.version)
        if stored.parent_version is not None:
            return stored.parent_version
    active = None if saved is None else saved.protocol.active_version
    if active is not None and active < config.version:
        return active
    return config.parent_version


def cmd_config_abort(settings: Settings, args: argparse.Namespace) -> int:
    """Abort the rollout in flight: the job goes back to its active version (000 §3.4)."""
    store: Path = args.store or settings.config_store
    with _control_channel(settings) as channel:
        controller = _controller(settings, channel, store)
        state = controller.state
        if state is None or state.current is None:
            last = None if state is None else state.last
            if last is None or last.finish is None:
                detail = f"the controller has no rollout on record in {controller.state_file}"
            elif last.finish.type == "ABORT":
                detail = f"the last one, v{last.version}, was already aborted"
            else:
                detail = (
                    f"v{last.version} is active; to roll back, publish a new version "
                    "with the old contents"
                )
            raise CliError(f"no rollout in flight: {detail}")
        message = controller.abort()
    print(f"sent {message.describe()}: the job goes back to v{state.active_version}")
    return 0


def _line(label: str, value: str) -> str:
    return f"{label:<12} {value}"


def _duration(seconds: float) -> str:
    """A short human duration: "42 s", "3 min 05 s", "2 h 07 min", "3 d 4 h"."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h} h"


def _since(moment: datetime) -> float:
    return (datetime.now(UTC) - moment).total_seconds()


def _job_line(status: JobStatus) -> str:
    if status.running is not None:
        record = status.running
        return f"running (pid {record.pid}, up {_duration(_since(record.started_at))})"
    if status.stale is not None:
        return (
            f"not running: its process (pid {status.stale.pid}) had died; "
            "removed the stale pid file"
        )
    return "not running"


def _rollout_line(status: JobStatus) -> str:
    rollout = status.rollout
    if status.rollout_problem is not None:
        return f"unknown: {status.rollout_problem}"
    if rollout is None:
        return "none on record"
    if rollout.in_flight is not None:
        text = f"v{rollout.in_flight} in flight from v{rollout.active_version}, {rollout.step}"
    else:
        text = f"idle at v{rollout.active_version}"
    if rollout.last_version is not None:
        outcome = "done" if rollout.last_outcome == "DONE" else "aborted"
        text += f"; last: v{rollout.last_version} {outcome}"
    return text


def _versions(versions: dict[str, int]) -> str:
    return ", ".join(f"{op} v{version}" for op, version in sorted(versions.items())) or "unknown"


def render_job_status(status: JobStatus, metrics_topic: str) -> list[str]:
    """``keyplane job status``: the process, what its batches did, and the rollout."""
    lines = [_line("job", _job_line(status))]
    if status.running is not None:
        lines.append(_line("aggregates", describe_aggregates(status.running.aggregates())))
    snapshot = status.metrics
    if status.metrics_problem is not None:
        lines.append(_line("metrics", f"unavailable: {status.metrics_problem}"))
    elif snapshot is None:
        lines.append(_line("metrics", f"no record on {metrics_topic} yet"))
    else:
        latest, busy = snapshot.latest, snapshot.last_busy
        lines += [
            _line("versions", _versions(latest.versions)),
            _line("last batch", f"{latest.batch_id} ({_duration(_since(snapshot.latest_at))} ago)"),
            _line("input lag", f"{latest.input_lag:,} events at that batch"),
        ]
        if busy is None:
            lines.append(_line("rows/s", "no batch with events among the last records"))
        else:
            lines.append(
                _line(
                    "rows/s",
                    f"{busy.rows_per_s:,.0f} (batch {busy.batch_id}: {busy.rows:,} rows "
                    f"in {busy.duration_ms / 1000:.1f} s)",
                )
            )
            locality = busy.locality
            lines.append(
                _line(
                    "locality",
                    "no A→B tuples"
                    if locality is None
                    else f"{locality:.1%} ({busy.local_hops:,} of {busy.hops:,} A→B tuples "
                    "stayed on their executor)",
                )
            )
            imbalances = [
                f"{op} {value:.2f}"
                for op in sorted(busy.load)
                if (value := busy.imbalance(op)) is not None
            ]
            lines.append(
                _line("imbalance", ", ".join(imbalances) + " (max/mean instance load)")
                if imbalances
                else _line("imbalance", "no load measured")
            )
    if status.events_waiting is not None:
        lines.append(_line("unread", f"{status.events_waiting:,} events past the checkpoint"))
    committed = status.committed
    if committed is not None:
        ago = _duration(_since(committed.committed_at))
        lines.append(_line("committed", f"{committed.describe()}, {ago} ago"))
    lines.append(_line("rollout", _rollout_line(status)))
    lines.append(_line("log", str(status.log)))
    return lines


def _import_from_the_working_directory() -> None:
    """Let a stage's ``module:attr`` name a module of the current directory, as the job does.

    The job runs as ``python -m`` in this directory, which puts it first on the
    job's import path; the ``keyplane`` script's path has the script's own
    directory there instead, so without this the check at the boundary would
    refuse a module the job imports (uvicorn's ``--app-dir`` does the same).
    """
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)


def _job_process(settings: Settings, args: argparse.Namespace) -> JobProcess:
    specs = (getattr(args, "stage_a_aggregate", None), getattr(args, "stage_b_aggregate", None))
    if any(specs) or getattr(args, "pipeline", None):
        _import_from_the_working_directory()
    return JobProcess(
        settings,
        pipeline=getattr(args, "pipeline", None),
        shuffle_partitions=getattr(args, "shuffle_partitions", None),
        max_offsets_per_trigger=getattr(args, "max_offsets_per_trigger", None),
        master=getattr(args, "master", None),
        stage_a_aggregate=specs[0],
        stage_b_aggregate=specs[1],
        forward=getattr(args, "forward", None),
        max_event_bytes=getattr(args, "max_event_bytes", None),
        restarts=getattr(args, "restarts", None),
        restart_delay_s=getattr(args, "restart_delay", None),
        stage_engine=getattr(args, "stage_engine", "auto"),
    )


def cmd_job(settings: Settings, args: argparse.Namespace) -> int:
    job = _job_process(settings, args)
    if args.action == "start":
        started = job.start(timeout_s=args.timeout)
        record = started.record
        if started.already_running:
            print(
                f"job already running (pid {record.pid}, up "
                f"{_duration(_since(record.started_at))}); nothing to do"
            )
            return 0
        if started.stale is not None:
            print(f"removed the stale pid file of pid {started.stale.pid} (its process had died)")
        first = started.first_progress
        if first is not None:
            batch = f"batch {first.batch_id} read {first.rows:,} events"
        elif started.events_waiting == 0:
            batch = "no events to read yet"
        else:
            batch = "its first batch read no events"
        print(
            f"job started (pid {record.pid}) in {started.ready_after_s:.0f} s: {batch}; "
            f"log {job.log}"
        )
        return 0
    if args.action == "stop":
        stopped = job.stop(timeout_s=args.timeout)
        if stopped.outcome == "not running":
            print("no job was running")
        elif stopped.outcome == "stale":
            assert stopped.record is not None
            print(
                f"no job was running; removed the stale pid file of pid {stopped.record.pid} "
                "(its process had died)"
            )
        elif stopped.outcome == "stopped":
            assert stopped.record is not None
            print(f"job stopped (pid {stopped.record.pid}, {stopped.seconds:.1f} s)")
        else:
            assert stopped.record is not None
            print(
                f"job killed (pid {stopped.record.pid}): it did not stop within "
                f"{args.timeout:.0f} s of SIGTERM; its checkpoint makes the restart exact"
            )
        return 0
    status = job.status()
    for line in render_job_status(status, settings.metrics_topic):
        print(line)
    return 0 if status.running is not None else 1


def cmd_airflow(settings: Settings, args: argparse.Namespace) -> int:
    """Airflow's UI, scheduler, dag processor and triggerer on this project's DAGs and plugin."""
    from keyplane.orchestration.dagrun import AirflowSetup
    from keyplane.orchestration.localairflow import LocalAirflow, project_folders, serve

    dags: Path | None = args.dags_folder
    plugins: Path | None = args.plugins_folder
    if dags is None or plugins is None:
        try:
            found = project_folders()
        except FileNotFoundError as missing:
            raise CliError(str(missing)) from None
        dags, plugins = dags or found[0], plugins or found[1]
    home = settings.home.resolve()
    local = LocalAirflow(
        setup=AirflowSetup(
            airflow_home=home / "airflow",
            dags_folder=dags.resolve(),
            bootstrap_servers=settings.resolved_bootstrap_servers(),
            keyplane_home=home,
            routing_store=settings.config_store.resolve(),
            events_topic=settings.events_topic,
            metrics_topic=settings.metrics_topic,
            control_topic=settings.control_topic,
            spark_master=settings.spark_master,
        ),
        plugins_folder=plugins.resolve(),
        port=args.port,
        parallelism=args.parallelism,
    )
    print(f"starting Airflow in {local.setup.airflow_home} (parallelism {local.parallelism})")
    return serve(local)


def cmd_stack(settings: Settings, args: argparse.Namespace) -> int:
    """Production on one machine: Kafka, Spark standalone, PostgreSQL, Airflow, the job."""
    from keyplane.stack.config import StackConfig
    from keyplane.stack.piece import StackError
    from keyplane.stack.stack import Stack

    stack = Stack(settings, StackConfig(), with_job=not getattr(args, "without_job", False))
    try:
        if args.action == "up":
            stack.up(print)
            print(f"stack up; logs under {stack.home}; `keyplane stack down` stops it")
            return 0
        if args.action == "down":
            stack.down(print)
            return 0
        made, healths = stack.status()
    except (StackError, FileNotFoundError) as error:
        raise CliError(str(error)) from None
    print(_line("network", made.describe()))
    for health in healths:
        state = "up" if health.up else "down"
        print(_line(health.piece, f"{state} at {health.url}: {health.detail}"))
    return 0 if all(health.up for health in healths) else 1


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    """One screen for the whole stack: is everything up, what runs, how far behind."""
    bootstrap = settings.resolved_bootstrap_servers()
    up = answers_kafka(bootstrap, timeout_s=2.0)
    if up:
        running, stale = EmbeddedBroker(settings.home, settings.broker_port).inspect()
        for removed in stale:
            print(removed.describe())
        name = {"embedded": "embedded", "kafka": "Apache Kafka"}
        detail = "" if running is None else f" ({name[running.engine]}, pid {running.pid})"
        lines = [_line("broker", f"up at {bootstrap}{detail}")]
    else:
        lines = [_line("broker", f"down at {bootstrap}: start it with `keyplane broker start`")]
    status = JobProcess(settings).status(read_metrics=up)
    lines.append(_line("job", _job_line(status)))
    if status.running is not None:
        lines.append(_line("aggregates", describe_aggregates(status.running.aggregates())))
    snapshot = status.metrics
    if snapshot is not None:
        latest = snapshot.latest
        ago = _duration(_since(snapshot.latest_at))
        lag = latest.input_lag if status.events_waiting is None else status.events_waiting
        lines += [
            _line("version", _versions(latest.versions)),
            _line("lag", f"{lag:,} events (last batch {latest.batch_id}, {ago} ago)"),
        ]
    elif status.metrics_problem is not None:
        lines.append(_line("version", f"unknown: {status.metrics_problem}"))
    elif up:
        lines.append(_line("version", f"unknown: no record on {settings.metrics_topic} yet"))
    lines.append(_line("rollout", _rollout_line(status)))
    for line in lines:
        print(line)
    return 0 if up and status.running is not None else 1


def _config_error_line(error: config_store.ConfigStoreError) -> str:
    """The store's message plus what to do about it, on one line."""
    if isinstance(error, config_store.UnknownVersionError):
        fix = "pass one of the stored versions"
    elif isinstance(error, config_store.ChecksumMismatchError):
        fix = "restore the file from a backup or publish a new version"
    else:
        fix = "check the store directory or publish a new version"
    return f"keyplane: {error}; {fix}".replace("\n", " ")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyplane",
        description="Control plane for stateful Spark Structured Streaming jobs: "
        "locality-aware routing, hot-key splitting and live state migration.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = sub.add_parser(
        "broker", help="start, stop or inspect the local broker (embedded, or Apache Kafka)"
    )
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument(
        "--port",
        type=_port,
        help="loopback port, 1 to 65535 (default: KEYPLANE_BROKER_PORT or 19092)",
    )
    broker.add_argument(
        "--storage",
        choices=["memory", "s3"],
        help="start: 'memory' (lost on stop) or 's3' (durable; default: KEYPLANE_BROKER_STORAGE "
        "or memory)",
    )
    broker.add_argument(
        "--allow-memory",
        action="store_true",
        help="start: start on memory storage even in a home whose last broker used s3 "
        "(an empty broker: that broker's topics stay in the object store)",
    )
    broker.add_argument(
        "--engine",
        choices=["embedded", "kafka"],
        help="'embedded' (no JVM, starts at once) or 'kafka': Apache Kafka, its logs kept under "
        "KEYPLANE_HOME/kafka (default: KEYPLANE_BROKER_ENGINE or embedded)",
    )
    broker.set_defaults(func=cmd_broker)

    topic = sub.add_parser("topic", help="create a topic or count its records")
    topic.add_argument("action", choices=["create", "describe"])
    topic.add_argument("name", type=_topic, help=_TOPIC_NAME_HELP)
    topic.add_argument(
        "--partitions",
        type=_count,
        default=8,
        help="partitions to create, 1 or more; an existing topic keeps its own (default: 8)",
    )
    topic.set_defaults(func=cmd_topic)

    for name, help_text, func in (
        ("generate", "write a generated workload to a Kafka topic", cmd_generate),
        ("demo", "run the main job end to end: broker, routed job, reconfiguration DAG", cmd_demo),
    ):
        cmd = sub.add_parser(name, help=help_text)
        kinds = cmd.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
        for kind, model in WORKLOADS.items():
            k = kinds.add_parser(kind, help=(model.__doc__ or "").strip().splitlines()[0])
            _add_model_options(k, model)
            k.add_argument(
                "--partitions",
                type=_count,
                default=8,
                help="topic partitions, 1 or more; an existing topic keeps its own (default: 8)",
            )
            k.add_argument(
                "--rate",
                type=_rate,
                default=None if name == "generate" else 20_000.0,
                help="events per second, a positive number (default: unlimited for generate, "
                "20000 for demo)",
            )
            if name == "generate":
                k.add_argument(
                    "--topic",
                    type=_topic,
                    help=f"target topic, {_TOPIC_NAME_HELP} (default: KEYPLANE_EVENTS_TOPIC)",
                )
            else:
                k.add_argument(
                    "--max-offsets-per-trigger",
                    type=_count,
                    default=20_000,
                    help="events per micro-batch at most (default: 20000)",
                )
        cmd.set_defaults(func=func)

    job = sub.add_parser(
        "job", help="start, stop or inspect the routed streaming job, a background process"
    )
    job_actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    job_start = job_actions.add_parser(
        "start",
        help="launch the routed job in the background (pid file and log in "
        "KEYPLANE_HOME/job) and wait until it is up; a running job is left alone, and "
        "options it does not run with are refused",
    )
    job_start.add_argument(
        "--pipeline",
        metavar="MODULE:ATTR",
        help="the job's pipeline (keyplane.Pipeline, or a function that returns one); its "
        "stages are fixed for the life of the checkpoint (default: KEYPLANE_PIPELINE, the "
        "reference two-stage count)",
    )
    job_start.add_argument(
        "--shuffle-partitions",
        type=_count,
        help="instances of each stateful operator (default: the checkpoint's on a restart, "
        "else the newest stored configuration's, else 4); a number that differs from "
        "either is refused",
    )
    job_start.add_argument(
        "--max-offsets-per-trigger",
        type=_count,
        help="events per micro-batch at most (default: every event available)",
    )
    job_start.add_argument(
        "--master", help="Spark master URL (default: KEYPLANE_SPARK_MASTER or local[2])"
    )
    for stage, keyed_by in (("a", "field 1, gets field 2"), ("b", "field 2, gets field 1")):
        job_start.add_argument(
            f"--stage-{stage}-aggregate",
            metavar="MODULE:ATTR",
            help=f"stage {stage.upper()}'s keyed aggregate (keyed by {keyed_by}), a "
            "keyplane.aggregates.KeyedAggregate instance or class; fixed for the life of the "
            "checkpoint (default: the running count)",
        )
    job_start.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        help="what stage A sends stage B: one row per (field-1, field-2) pair and micro-batch "
        "with its weight (pairs), or every tuple with its padding, so the shuffle between the "
        "stages carries the tuples (tuples) (default: pairs)",
    )
    job_start.add_argument(
        "--max-event-bytes",
        type=_count,
        help="the largest event record the job parses, in bytes; a larger one goes to the "
        "dead-letter topic as 'oversized'; the statistics should use the same bound, so set "
        f"KEYPLANE_MAX_EVENT_BYTES instead where they run (default: it, or {MAX_EVENT_BYTES:,})",
    )
    job_start.add_argument(
        "--stage-engine",
        choices=STAGE_ENGINES,
        default="auto",
        help="where the stages run: jvm (Java stateful processors, the running count only), "
        "python (any aggregate) or auto (the JVM when both stages run the running count); "
        "fixed for the life of the checkpoint (default: auto, or the checkpoint's own)",
    )
    job_start.add_argument(
        "--restarts",
        type=int,
        help="start the query again from its checkpoint, in the same process, up to this many "
        "times after it fails (a broker down past the producers' delivery timeout, a failed "
        "task); the failed batch is replayed exactly (default: 0, the job ends)",
    )
    job_start.add_argument(
        "--restart-delay",
        type=_seconds_or_zero,
        help="wait this long before each restart, so that a broker can return; 0: restart at "
        "once (default: 10)",
    )
    job_start.add_argument(
        "--timeout",
        type=_seconds,
        default=START_TIMEOUT_S,
        help="seconds to wait for the job to be up (its first micro-batch, or its query "
        "running when there are no events to read) before stopping it "
        f"(default: {START_TIMEOUT_S:.0f})",
    )
    job_stop = job_actions.add_parser(
        "stop", help="stop the job cleanly between micro-batches (SIGTERM, then SIGKILL)"
    )
    job_stop.add_argument(
        "--timeout",
        type=_seconds,
        default=STOP_TIMEOUT_S,
        help=f"seconds to wait for a clean stop before SIGKILL (default: {STOP_TIMEOUT_S:.0f})",
    )
    job_actions.add_parser(
        "status",
        help="running or not; routing versions, last batch, rows/s, lag, locality, "
        "imbalance from the metrics topic; the controller's rollout (exit 1: not running)",
    )
    job.set_defaults(func=cmd_job)

    overview = sub.add_parser(
        "status",
        help="one screen: broker up, job running, active routing versions, lag, last rollout "
        "(exit 1 unless broker and job both run)",
    )
    overview.set_defaults(func=cmd_status)

    airflow = sub.add_parser(
        "airflow",
        help="run Airflow (UI, scheduler, dag processor, triggerer) on this project's DAGs and "
        "dashboard plugin; prints the URL and how to log in",
    )
    airflow.add_argument(
        "--port", type=_port, default=8080, help="port of the UI and API (default: 8080)"
    )
    airflow.add_argument(
        "--parallelism",
        type=_count,
        default=4,
        help="task slots of the LocalExecutor (default: 4, for a small machine)",
    )
    airflow.add_argument("--dags-folder", type=Path, help="default: the project's dags/")
    airflow.add_argument("--plugins-folder", type=Path, help="default: the project's plugins/")
    airflow.set_defaults(func=cmd_airflow)

    stack = sub.add_parser(
        "stack",
        help="production on one machine: Apache Kafka, a Spark standalone master and workers "
        "(on shaped links where namespaces can be made), PostgreSQL, Airflow's four components "
        "and the routed job; up, down, or each piece's status (exit 1 unless all are up)",
    )
    stack.add_argument("action", choices=("up", "down", "status"))
    stack.add_argument(
        "--without-job", action="store_true", help="up: everything but the routed job"
    )
    stack.set_defaults(func=cmd_stack)

    configs = sub.add_parser(
        "config", help="show or diff stored routing configurations; publish one live or abort it"
    )
    actions = configs.add_subparsers(dest="action", required=True, metavar="ACTION")
    store_help = "configuration store (default: KEYPLANE_HOME/configs)"
    show = actions.add_parser(
        "show", help="a version's lineage, checksum, tables and hot keys per operator"
    )
    show.add_argument(
        "version",
        nargs="?",
        type=_version,
        help="version to show (default: the active one, the controller's; before any rollout "
        "the newest version that was not planned and left unpublished)",
    )
    show.add_argument("--store", type=Path, help=store_help)
    listing = actions.add_parser(
        "list", help="stored versions, newest first, with their parent, origin and status"
    )
    listing.add_argument(
        "--all",
        action="store_true",
        help="also the versions a run planned but did not publish",
    )
    listing.add_argument("--store", type=Path, help=store_help)
    diff = actions.add_parser(
        "diff", help="the keys, hot keys and state transfers that going from OLD to NEW moves"
    )
    diff.add_argument("a", metavar="OLD", type=_version, help="the version replaced")
    diff.add_argument("b", metavar="NEW", type=_version, help="the version replacing it")
    diff.add_argument("--store", type=Path, help=store_help)
    diff.add_argument(
        "--statistics",
        type=Path,
        help="statistics snapshots to score both versions on, for the expected gain "
        "(default: KEYPLANE_HOME/statistics)",
    )
    publish = actions.add_parser(
        "publish",
        help="store a configuration file and roll it out to the running job, operator by operator",
    )
    publish.add_argument(
        "file",
        metavar="FILE",
        type=Path,
        help="a routing configuration as JSON; it carries its version and parent_version",
    )
    publish.add_argument("--store", type=Path, help=store_help)
    publish.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        help="seconds to wait for each reply of the job before aborting (default: 120)",
    )
    publish.add_argument(
        "--max-moves-per-wave",
        type=_count,
        metavar="N",
        help="roll the change out in waves that each move at most N keys, numbered from "
        "FILE's version on: a smaller dip in throughput over more micro-batches",
    )
    publish.add_argument(
        "--no-job-check",
        action="store_true",
        help="skip the checks against the job of KEYPLANE_HOME (that it runs, its state "
        "partitions and operators), for a job started elsewhere; the job still refuses a "
        "version it cannot take",
    )
    publish.add_argument(
        "--no-wait",
        action="store_true",
        help="store and send PREPARE only; the same command without it finishes the rollout",
    )
    abort = actions.add_parser(
        "abort", help="abort the rollout in flight: the job goes back to its active version"
    )
    abort.add_argument("--store", type=Path, help=store_help)
    configs.set_defaults(func=cmd_config)
    return parser


_Number = TypeVar("_Number", int, float)


def _bounded(
    parse: Callable[[str], _Number],
    what: str,
    *,
    above: _Number | None = None,
    at_least: _Number | None = None,
    at_most: _Number | None = None,
) -> Callable[[str], _Number]:
    """An argparse type: ``parse``'s value of the text if it lies within every bound
    given, else an error naming ``what`` the argument must be.

    Each bound is a keyword so that a call site reads as the range it accepts
    (``at_least=1, at_most=65535``), an open end (``above=0.0``) included.
    """

    def convert(text: str) -> _Number:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (
            (above is not None and not value > above)
            or (at_least is not None and not value >= at_least)
            or (at_most is not None and not value <= at_most)
        ):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return convert


def _finite(text: str) -> float:
    """``float(text)``, refusing ``inf`` as it does ``nan``: neither is a rate."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite")
    return value


def _topic(text: str) -> str:
    """An argparse type: a topic name Kafka accepts (:func:`check_topic_name`)."""
    try:
        return check_topic_name(text)
    except TopicError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_TOPIC_NAME_HELP = "1 to 249 letters, digits, '.', '_' or '-'"

_version = _bounded(int, "a version (an integer from 1)", at_least=1)
_count = _bounded(int, "a positive integer", at_least=1)
_port = _bounded(int, "a port (an integer from 1 to 65535)", at_least=1, at_most=65535)
_rate = _bounded(_finite, "a positive number of events per second", above=0.0)
_seconds = _bounded(float, "a positive number of seconds", above=0.0)
_seconds_or_zero = _bounded(float, "a number of seconds, 0 or more", at_least=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings()
        return int(args.func(settings, args))
    except ValidationError as exc:
        print(f"keyplane: invalid {first_problem(exc, 'input')}", file=sys.stderr)
    except (
        AggregateSpecError,
        PipelineError,
        BrokerError,
        TopicError,
        CliError,
        ControllerError,
        JobError,
        ProtocolError,
        MissingKeyError,
    ) as exc:
        print(f"keyplane: {exc}", file=sys.stderr)
    except config_store.ConfigStoreError as exc:
        print(_config_error_line(exc), file=sys.stderr)
    except BrokenPipeError:
        # The reader stopped reading (`| head`): what it read is what it wanted. Point
        # stdout at /dev/null so that the interpreter's own flush at exit fails silently.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # A path that is a file where a directory belongs, a full disk, no permission.
        where = f": {exc.filename}" if exc.filename else ""
        print(f"keyplane: {exc.strerror or exc}{where}", file=sys.stderr)
    except KafkaError as exc:
        print(
            f"keyplane: Kafka did not answer ({type(exc).__name__}: {exc}); "
            "is the broker running? `keyplane broker status`",
            file=sys.stderr,
        )
    except KeyboardInterrupt:
        print("keyplane: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())

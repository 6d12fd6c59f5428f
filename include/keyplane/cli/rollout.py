"""``keyplane config publish|abort``: store a routing configuration and roll it out to the
running job live, or abort the rollout in flight (paper 000 §3.4).

Everything that can be checked before a version number is used for good is
checked here first, so that a refused version stores and sends nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from keyplane.cli.errors import CliError
from keyplane.control.controller import (
    Controller,
    ControllerFile,
    RolloutProgress,
    RolloutTimeout,
    read_controller_file,
)
from keyplane.control.operators import stage_names
from keyplane.control.signing import control_key
from keyplane.kafka.control import ControlChannel
from keyplane.pipeline import PipelineError
from keyplane.routing import config as config_store
from keyplane.routing.config import RoutingConfig
from keyplane.routing.routedkeys import spark_partition
from keyplane.routing.waves import split_into_waves
from keyplane.settings import Settings
from keyplane.spark.job_status import read_metrics_topic
from keyplane.spark.jobprocess import JobProcess
from keyplane.util.statefiles import os_reason
from keyplane.util.validation_errors import first_problem


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

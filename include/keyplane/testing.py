"""Helpers for testing keyplane deployments and user jobs.

Shipped with the library (like Bytewax's testing module) so users can write
the same kind of integration tests against their own routed stages.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from keyplane.aggregates import RunningCount
from keyplane.control.job_protocol import JobProtocol, JobState
from keyplane.control.messages import ChecksumLookup, ControlMessage
from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import EmbeddedBroker, port_is_free
from keyplane.kafka.control import ControlChannel
from keyplane.orchestration.deployment import routed_job_topics
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.routing import config as config_store
from keyplane.routing.routedkeys import spark_partition
from keyplane.spark.job_checkpoint import events_read, newest_offset_log_entry, source_offset
from keyplane.spark.progress import records_read

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql.streaming import StreamingQuery

    from keyplane.aggregates import KeyedAggregate
    from keyplane.orchestration.deployment import Deployment
    from keyplane.spark.counts_job import CountsJobSettings
    from keyplane.spark.executors import ExecutorControl, ExecutorReply


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def crash_broker(broker: EmbeddedBroker | ApacheKafkaBroker, timeout_s: float = 30.0) -> None:
    """SIGKILL the broker alone, as a crash would, and wait until its port is free.

    On ``s3`` storage the local S3 server keeps running, and Apache Kafka's
    log directories stay on disk, so the broker's next ``start`` finds every
    record it acknowledged.
    """
    state = broker.status()
    if state is None:
        raise RuntimeError(f"the broker in {broker.home} is not running")
    os.killpg(state.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while broker.status() is not None or not port_is_free(broker.port):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the killed broker still holds port {broker.port} after {timeout_s} s"
            )
        time.sleep(0.05)


def moved_off_hash(keys: Iterable[str], parallelism: int, shift: int = 1) -> dict[str, int]:
    """Table entries that put each key ``shift`` instances past its hash instance.

    A routing table that moves keys for certain: ``shift`` (mod
    ``parallelism``) other than 0 never names the instance hash routing
    would pick, so every key in it changes instance when the table goes live.
    """
    if shift % parallelism == 0:
        raise ValueError(f"shift {shift} moves no key over {parallelism} instances")
    return {key: (spark_partition(key, parallelism) + shift) % parallelism for key in keys}


def moved_off_hash_config(
    version: int,
    keys: Mapping[str, Iterable[str]],
    parallelism: int,
    *,
    shifts: Mapping[str, int] | None = None,
    hot_keys: Mapping[str, Mapping[str, tuple[int, ...]]] | None = None,
) -> config_store.RoutingConfig:
    """Version ``version`` whose tables move each operator's ``keys`` off their hash
    instance (:func:`moved_off_hash`, by the operator's entry in ``shifts``, else 1), and
    split the operator's entries in ``hot_keys`` over the instances given.

    Version 1 is an initial configuration; any other is the child of the one
    before. A test states the moves and splits it checks, not the configuration's
    bookkeeping.
    """
    shifts = shifts or {}
    hot_keys = hot_keys or {}
    return config_store.RoutingConfig(
        version=version,
        parent_version=None if version == 1 else version - 1,
        created_by="initial" if version == 1 else "manual",
        operators={
            operator: config_store.OperatorRouting(
                parallelism=parallelism,
                table=moved_off_hash(moved, parallelism, shifts.get(operator, 1)),
                hot_keys=dict(hot_keys.get(operator, {})),
            )
            for operator, moved in keys.items()
        },
    )


def split_then_unsplit(
    a_keys: Sequence[str], b_keys: Sequence[str], parallelism: int
) -> tuple[config_store.RoutingConfig, config_store.RoutingConfig]:
    """Two versions of the reference stages that move and split keys, heaviest keys first.

    v1 moves each stage's keys 2 to 4 off their hash instance and splits its
    heaviest key over three instances. v2, live after it, pins stage A's hot
    key to one instance (a split undone, so its partials merge), moves stage
    B's keys 3 to 5, and narrows B's hot key to two instances.
    """
    p = parallelism
    v1 = moved_off_hash_config(
        1,
        {FIRST_STAGE: a_keys[1:4], SECOND_STAGE: b_keys[1:4]},
        p,
        hot_keys={FIRST_STAGE: {a_keys[0]: (0, 1, 3)}, SECOND_STAGE: {b_keys[0]: (1, 2, 3)}},
    )
    v2 = config_store.RoutingConfig(
        version=2,
        parent_version=1,
        created_by="manual",
        operators={
            FIRST_STAGE: config_store.OperatorRouting(
                parallelism=p, table={**moved_off_hash(a_keys[1:4], p, 2), a_keys[0]: 2}
            ),
            SECOND_STAGE: config_store.OperatorRouting(
                parallelism=p, table=moved_off_hash(b_keys[2:5], p, 3), hot_keys={b_keys[0]: (0, 2)}
            ),
        },
    )
    return v1, v2


def stage_keys_by_count(truth: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Stage A's and stage B's keys in ``truth`` (``stage, key, count``), most counted first.

    Ties keep ``truth``'s order (a stable sort), so the same workload always
    gives the same lists: a test picks the keys its configurations move or
    split by rank (the hottest, the next few), and every run picks the same.
    """
    by_count = truth.sort_values("count", ascending=False, kind="mergesort")
    a_keys = by_count.loc[by_count["stage"] == FIRST_STAGE, "key"].tolist()
    b_keys = by_count.loc[by_count["stage"] == SECOND_STAGE, "key"].tolist()
    return a_keys, b_keys


def routed_job_settings(
    bootstrap_servers: str,
    topic: str,
    work: Path,
    *,
    parallelism: int,
    batch: int,
    trigger: str,
    version: int | None = None,
    **fields: Any,
) -> CountsJobSettings:
    """The routed job reading ``topic`` over ``parallelism`` state partitions, at most
    ``batch`` events a micro-batch, one every ``trigger`` (``"1 second"``), starting a
    new checkpoint on ``version`` of its store (default the latest).

    Everything it writes or reads besides the broker lives in ``work``: the
    checkpoint (``work/checkpoint``), the output (``work/output``) and the
    routing store (``work/routing``), where the test saves the configurations
    it rolls out. Its protocol topics are its own (:func:`routed_job_topics` of
    ``topic``), so jobs sharing a broker keep apart. ``fields`` are any other
    settings, or ones to change (``routing_store=None``: the plain job, not
    routed). Every setting is set explicitly, so
    :func:`~keyplane.spark.counts_job.job_command` passes each to the job's
    process.
    """
    from keyplane.spark.counts_job import CountsJobSettings

    values: dict[str, Any] = {
        "checkpoint": work / "checkpoint",
        "output": work / "output",
        "routing_store": work / "routing",
    }
    if version is not None:
        values["routing_version"] = version
    return CountsJobSettings(
        bootstrap_servers=bootstrap_servers,
        events_topic=topic,
        shuffle_partitions=parallelism,
        max_offsets_per_trigger=batch,
        trigger_interval=trigger,
        **(values | fields),
        **routed_job_topics(topic),
    )


def paired_tuple_counts(
    n_keys: int, seed: int, hot: Mapping[str, int] | None = None
) -> pd.DataFrame:
    """A window's tuple counts (``a, b, holdout, n``) in which each A key pairs with one B key.

    Stage-A key ``a`` (``"0"`` … ``n_keys - 1``) meets B key ``1000 + a mod
    n_keys/2`` in 200 to 399 tuples (times its factor in ``hot``), 80 % of them
    in the window and 20 % in the holdout; so two A keys share each B key and a
    plan can co-locate them. Random but fixed by ``seed``: a synthetic input
    for :func:`write_statistics_snapshot`.
    """
    import numpy as np
    import pandas as pd

    hot = hot or {}
    rng = np.random.default_rng(seed)
    rows = []
    for a in range(n_keys):
        n = int(rng.integers(200, 400)) * hot.get(str(a), 1)
        b = str(1000 + a % (n_keys // 2))
        rows += [(str(a), b, False, int(n * 0.8)), (str(a), b, True, int(n * 0.2))]
    return pd.DataFrame(rows, columns=["a", "b", "holdout", "n"])


def deployment_under(
    home: Path, bootstrap_servers: str = "127.0.0.1:1", topic_prefix: str = ""
) -> Deployment:
    """The DAG steps' deployment in ``home``, its configuration store ``home/configs``.

    The default bootstrap address answers nothing: enough for the steps that
    only read and write files. ``topic_prefix`` keeps deployments that share a
    broker apart.
    """
    from keyplane.orchestration.deployment import Deployment

    return Deployment.under(
        home,
        bootstrap_servers=bootstrap_servers,
        events_topic=f"{topic_prefix}events",
        metrics_topic=f"{topic_prefix}metrics",
        control_topic=f"{topic_prefix}control",
        routing_store=home / "configs",
    )


def write_statistics_snapshot(
    snapshots: Path,
    run_id: str,
    grouped: pd.DataFrame,
    stages: Sequence[str] = (FIRST_STAGE, SECOND_STAGE),
) -> None:
    """Write run ``run_id``'s statistics snapshot from ``grouped`` (each of ``stages``' key,
    upstream first, then ``holdout, n``; :func:`keyplane.algorithms.statistics.chain_rows`), as the
    statistics job would for a job on v1 with one metrics record.

    The DAG's later steps (validation, planning, backtest, decision) read
    only the snapshot, so a test can drive them, or fill a dashboard's home,
    without running Spark.
    """
    from keyplane.algorithms import statistics as stats
    from keyplane.algorithms.batchmetrics import BatchMetrics

    total = int(grouped["n"].sum())
    manifest, frames = stats.build_snapshot(
        run_id=run_id,
        grouped=stats.chain_rows(grouped, stages),
        stages=stages,
        metrics=[BatchMetrics(batch_id=0, versions=dict.fromkeys(stages, 1))],
        events=stats.TopicWindow(topic="events", start={0: 0}, end={0: total}),
        metrics_window=stats.TopicWindow(topic="metrics", start={0: 0}, end={0: 1}),
        previous=None,
        config=None,
        settings=stats.StatisticsSettings(),
    )
    stats.write_snapshot(snapshots, manifest, **frames)


@contextmanager
def answering(control: ExecutorControl, poll_s: float = 0.2) -> Iterator[list[ExecutorReply]]:
    """A thread that polls ``control`` as the job's main loop does, until it has answered
    once; yields the replies it sent, complete when the block ends."""
    answered: list[ExecutorReply] = []
    stop = threading.Event()

    def driver() -> None:
        while not stop.is_set() and not answered:
            answered.extend(control.poll())
            stop.wait(poll_s)

    thread = threading.Thread(target=driver, name="executor-control")
    thread.start()
    try:
        yield answered
    finally:
        stop.set()
        thread.join(timeout=30)


def start_job_process(settings: CountsJobSettings, log: Path) -> subprocess.Popen[bytes]:
    """The job with ``settings`` as its own process (and session), output appended to ``log``.

    Its own session, so a test can SIGKILL the driver with its JVM
    (``os.killpg``) as a crash would.
    """
    from keyplane.spark.counts_job import job_command

    with log.open("ab") as out:
        return subprocess.Popen(
            job_command(settings), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def events_read_by_connector(checkpoint: Path, topic: str) -> int | None:
    """Events of ``topic`` that Spark's Kafka connector had read through by the newest batch
    in ``checkpoint``'s offset log (its own offset there, ``{topic: {partition: offset}}``).

    None when keyplane's routed source read events of ``topic`` itself, when no
    connector's offset of ``topic`` is there, or before the first batch: a test of
    the job with source ``jvm`` checks with it that the connector really read the events.
    """
    lines = newest_offset_log_entry(checkpoint)
    own = source_offset(lines or [])
    if lines is None or own is None or topic in own["events"]:
        return None
    read = events_read(lines, topic)
    return sum(read.values()) if read else None


def wait_while_job_runs(
    condition: Callable[[], bool],
    what: str,
    job: subprocess.Popen[bytes],
    log: Path,
    *,
    timeout_s: float = 180,
    poll_s: float = 0.2,
) -> None:
    """Poll ``condition`` until it holds; fail with the job's log if the job exits first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job.poll() is not None:
            raise AssertionError(f"job exited while waiting for {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def wait_for_records(
    query: StreamingQuery, records: int, *, timeout_s: float = 120, poll_s: float = 0.2
) -> None:
    """Poll until ``query`` has read ``records`` events; fail with its error if it stopped.

    The in-process twin of :func:`wait_while_job_runs`, for a query started
    on the test's own session.
    """
    deadline = time.monotonic() + timeout_s
    while records_read(query) < records:
        if query.exception() is not None:
            raise AssertionError(f"the query failed while reading: {query.exception()}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"the query read fewer than {records} events in {timeout_s} s")
        time.sleep(poll_s)


def store_checksums(store: Path) -> ChecksumLookup:
    """The job's view of a configuration store: a version's checksum, or None if not stored."""

    def lookup(version: int) -> str | None:
        try:
            return config_store.checksum(store, version)
        except config_store.UnknownVersionError:
            return None

    return lookup


class ProtocolOnlyJob:
    """A stand-in for a routed job's Spark driver: the job protocol alone, on a real topic.

    It runs the real :class:`~keyplane.control.job_protocol.JobProtocol` of paper 000 §3.4
    over a real :class:`~keyplane.kafka.control.ControlChannel` and nothing
    else: no Spark, and no state moving through the migration topic. It lets
    the controller, a DAG or a CLI be tested end to end over Kafka while the
    Spark side is tested on its own.

    A thread plays a micro-batch boundary every ``batch_interval_s``: it reads
    the control topic from where it stopped, hands each message to the
    protocol, plans the next batch, and reports a moving operator's state as
    installed one batch after its switch batch (where the real job installs
    the state it shipped). Replies go back on the topic, as the driver's do.
    Use it as a context manager; an error in the thread fails the ``with``.
    """

    def __init__(
        self,
        channel: ControlChannel,
        store: Path,
        operators: Sequence[str],
        active_version: int,
        *,
        batch_interval_s: float = 0.05,
    ) -> None:
        self._channel = channel
        self._protocol = JobProtocol(
            operators,
            active_version,
            config_store.checksum(store, active_version),
            lookup_checksum=store_checksums(store),
        )
        self._interval = batch_interval_s
        self._offset = 0
        self._batch = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="protocol-only-job", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._channel.close()
        if self._error is not None and exc is None:
            raise AssertionError("the protocol-only job failed") from self._error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._boundary()
                self._stop.wait(self._interval)
        except BaseException as exc:
            self._error = exc

    def _boundary(self) -> None:
        read = self._channel.read(self._offset)
        replies: list[ControlMessage] = []
        with self._lock:
            protocol, batch = self._protocol, self._batch
            for _, message in read.messages:
                replies += protocol.on_message(message, batch)
            protocol.begin_batch(batch)
            for handoff in protocol.migrating():
                if handoff.switch_batch is not None and handoff.switch_batch < batch:
                    replies += protocol.state_installed(handoff.operator, batch)
            self._offset, self._batch = read.end, batch + 1
        self._channel.send(replies)

    @property
    def state(self) -> JobState:
        """The protocol's state at the last boundary (a frozen snapshot)."""
        with self._lock:
            return self._protocol.state

    def wait_until(self, condition: Callable[[JobState], bool], timeout_s: float = 20.0) -> bool:
        """Whether ``condition`` held for the job's state within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.state):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def check_aggregate_laws(aggregate: KeyedAggregate[Any], batches: Sequence[Sequence[str]]) -> None:
    """Fail with the broken law if ``aggregate`` breaks the contract on these ``batches``.

    Each batch is one micro-batch's values for one key. The laws are those a
    routed stage relies on (:mod:`keyplane.aggregates`): ``zero`` is merge's
    identity (a tombstone changes nothing), ``merge`` is commutative and
    associative (partials meet in any order), ``add`` distributes over
    ``merge`` (a split key's partials merge to the unsplit state, 001
    §4.1.2), states survive ``encode``/``decode`` as text (the migration
    topic, 000 §3.4), results are JSON-safe, and no call mutates its
    arguments. States are compared by their ``result``. Pure: drive it with
    a property-testing library, e.g. ``@given(lists(lists(text())))``.
    """
    agg = aggregate

    def merge(x: Any, y: Any) -> Any:
        rx, ry = agg.result(x), agg.result(y)
        out = agg.merge(x, y)
        if agg.result(x) != rx or agg.result(y) != ry:
            raise AssertionError("merge mutated one of its argument states")
        return out

    def add(state: Any, batch: Sequence[str]) -> Any:
        before = agg.result(state)
        out = agg.add(state, list(batch))
        if agg.result(state) != before:
            raise AssertionError("add mutated its argument state")
        return out

    def same(x: Any, y: Any, law: str) -> None:
        if agg.result(x) != agg.result(y):
            raise AssertionError(f"{law}: {agg.result(x)!r} != {agg.result(y)!r}")

    zero = agg.zero()
    partials = [add(agg.zero(), batch) for batch in batches]
    for state in [zero, *partials]:
        text = agg.encode(state)
        if not isinstance(text, str):
            raise AssertionError(f"encode returned {type(text).__name__}, not str")
        same(agg.decode(text), state, "decode(encode(s)) == s")
        json.dumps(agg.result(state))
        same(merge(zero, state), state, "merge(zero, s) == s")
        same(merge(state, agg.decode(agg.encode(zero))), state, "merge(s, zero) == s")
    for x, y in itertools.pairwise(partials):
        same(merge(x, y), merge(y, x), "merge(a, b) == merge(b, a)")
    for x, y, z in zip(partials, partials[1:], partials[2:], strict=False):
        same(
            merge(merge(x, y), z),
            merge(x, merge(y, z)),
            "merge(merge(a, b), c) == merge(a, merge(b, c))",
        )
    merged, running = zero, zero
    for batch, partial in zip(batches, partials, strict=True):
        merged = merge(merged, partial)
        running = add(running, batch)
    whole = add(zero, [value for batch in batches for value in batch])
    same(merged, whole, "merging the partials == adding every value to zero")
    same(running, whole, "adding batch after batch == adding every value at once")


FAIL_ONCE_DIR_ENV = "KEYPLANE_FAIL_ONCE_DIR"
"""Directory through which a test arms :class:`FailsOnceWhenArmed` in a job's Spark tasks."""


class InjectedFailure(RuntimeError):
    """The failure :class:`FailsOnceWhenArmed` raises inside a Spark task."""


class FailsOnceWhenArmed(RunningCount):
    """A running count whose ``add`` fails once, in whichever task first sees it armed.

    For testing a job's recovery from a failed micro-batch: the test starts
    the job with ``KEYPLANE_FAIL_ONCE_DIR`` set (Spark's Python workers
    inherit the job's environment), lets some batches commit, then creates
    ``armed`` in that directory. The next ``add`` creates ``fired`` and
    raises :class:`InjectedFailure`, which fails the batch and the query;
    every later ``add`` counts normally. Use it as a stage's aggregate,
    ``keyplane.testing:FailsOnceWhenArmed``.
    """

    def add(self, state: int, values: Sequence[str]) -> int:
        folder = os.environ.get(FAIL_ONCE_DIR_ENV)
        if folder and (Path(folder) / "armed").exists():
            try:
                (Path(folder) / "fired").touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                raise InjectedFailure(f"injected failure of one micro-batch ({folder})")
        return super().add(state, values)


POISON_VALUE = "poison"
"""The value :class:`RaisesOnPoison` cannot count."""


class RaisesOnPoison(RunningCount):
    """A running count whose ``add`` raises whenever its values hold :data:`POISON_VALUE`.

    A user's aggregate with a bug that one value triggers on every try, for the
    poison-record tests (:mod:`keyplane.control.quarantine`); use it as a stage's aggregate,
    ``keyplane.testing:RaisesOnPoison``.
    """

    def add(self, state: int, values: Sequence[str]) -> int:
        if POISON_VALUE in values:
            raise ValueError(f"cannot count {POISON_VALUE!r}")
        return super().add(state, values)


class WaitingCount(RunningCount):
    """A running count that waits ``seconds_per_tuple`` for every tuple it adds.

    A stage that costs more per tuple than another with as many tuples, as an
    aggregate that looks every event up elsewhere does: only its measured
    busy time, not its tuple count, shows that it holds most of a batch
    (paper 003 §4.1). It waits rather than computes, so that a test of it
    loads no core. Use it as a stage's aggregate, ``keyplane.testing:WaitingCount``.
    """

    def __init__(self, seconds_per_tuple: float = 0.002) -> None:
        if not 0 <= seconds_per_tuple < float("inf"):
            raise ValueError(f"seconds_per_tuple must be >= 0, got {seconds_per_tuple}")
        self.seconds_per_tuple = seconds_per_tuple

    def add(self, state: int, values: Sequence[str]) -> int:
        time.sleep(self.seconds_per_tuple * len(values))
        return super().add(state, values)

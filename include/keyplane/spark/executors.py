"""The running job's executors, changed live from ``keyplane_scale`` (paper 003, Stela).

Stela scales a running job out by giving it one more machine and in by
taking one away (003 §5). In Spark the machines are executors, and the one
process that may ask the cluster manager for them is the job's driver
(``SparkContext.requestExecutors`` and ``killExecutors``, with dynamic
allocation off). So the scale DAG sends a signed :class:`ExecutorCommand` on
the job's executors topic (the control topic's name with ``.executors``),
the driver acts on it between two of its progress polls, waits until the
cluster has done it, and answers with an :class:`ExecutorReply` naming the
executors it saw before and after. The query is never stopped: its stream
thread goes on committing batches while the driver waits.

What keyplane decides and what Spark does. keyplane decides how many
executors the application holds, and which one a scale-in releases. Spark
decides where each state partition's task runs: it waits up to
``spark.locality.wait`` for the executor that loaded that partition's state
store last, so after a scale-out a task moves to the new executor only when
that wait runs out, and after a scale-in Spark loads the released
executor's state stores elsewhere from the checkpoint. The job's metrics report the
executor each instance ran on, which is how to see where they went.

The driver pins the executor count once its first batch has run
(:meth:`ExecutorControl.pin`): a standalone master otherwise hands an
application every core up to ``spark.cores.max`` as workers join, and the
count would change without a scale run. A scale-out can only add an
executor the cluster has room for: a worker with a free core and memory,
and ``spark.cores.max`` above the cores the job holds. Local mode has one
executor, the driver, and refuses every command.

The wire form is the control topic's: canonical JSON signed with
``KEYPLANE_CONTROL_KEY`` (:mod:`keyplane.control.signing`), on a topic of one
partition so that a reply follows its command.

A command is carried out at most once. Its id is derived from the scale run
and the action (:func:`command_id`), so a retried step sends the same
command; the step first looks for a reply to it on the topic
(:func:`request`), and the driver answers a command it has answered before
with that first reply (:class:`ExecutorControl`). Otherwise a step retried
after its reply was lost would add (or release) a second executor that no run
recorded.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Literal
from uuid import NAMESPACE_URL, UUID, uuid4, uuid5

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from keyplane.control.messages import authentic_object
from keyplane.control.signing import canonical_json, control_key, sign

if TYPE_CHECKING:
    from kafka import KafkaConsumer
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

log = logging.getLogger(__name__)

LOCAL_MODE_REFUSAL = "executors cannot be added in local mode; run on a cluster"
MAX_WAIT_S = 3600.0
"""The longest wait for a command: ``keyplane_scale``'s longest ``reply_timeout_s``."""
PARTITION = 0


def executors_topic(control_topic: str) -> str:
    """The topic that carries executor commands and replies for the job of ``control_topic``."""
    return f"{control_topic}.executors"


def _now() -> datetime:
    return datetime.now(UTC)


def command_id(topic: str, run_id: str, action: Literal["add", "release"]) -> UUID:
    """The id of ``action``'s command in the scale run ``run_id`` of the job of ``topic``.

    The same for every try of the run's step, so the driver and the step
    recognise a retried command; different for another run or action.
    """
    return uuid5(NAMESPACE_URL, "keyplane-executors:" + json.dumps([topic, run_id, action]))


class ExecutorCommand(BaseModel):
    """Add one executor, or release one (``executor``: which; None: the newest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["EXECUTORS"] = "EXECUTORS"
    action: Literal["add", "release"]
    executor: str | None = Field(default=None, min_length=1, max_length=64)
    wait_s: float = Field(default=120.0, gt=0.0, le=MAX_WAIT_S)
    """How long the driver waits for the cluster to register (or remove) the executor."""
    request_id: UUID = Field(default_factory=uuid4)
    sent_at: AwareDatetime = Field(default_factory=_now)


class ExecutorReply(BaseModel):
    """The driver's answer: the executors it saw before and after, or why it refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["EXECUTORS_REPLY"] = "EXECUTORS_REPLY"
    request_id: UUID
    outcome: Literal["applied", "refused"]
    before: tuple[str, ...]
    after: tuple[str, ...]
    changed: str | None = None
    """The executor added or released."""
    seconds: float = Field(ge=0.0)
    """From the driver reading the command to the cluster having done it."""
    reason: str | None = Field(default=None, max_length=500)


ExecutorMessage = Annotated[ExecutorCommand | ExecutorReply, Field(discriminator="type")]
_MESSAGE: TypeAdapter[ExecutorCommand | ExecutorReply] = TypeAdapter(ExecutorMessage)


class ExecutorError(RuntimeError):
    """An executor command that could not be carried out, in one line."""


def encode(message: ExecutorCommand | ExecutorReply, key: bytes) -> bytes:
    body = message.model_dump(mode="json")
    return canonical_json({**body, "signature": sign(body, key)})


def decode(raw: bytes, key: bytes) -> ExecutorCommand | ExecutorReply:
    """The authentic message in ``raw``, checked as a control message is
    (:func:`keyplane.control.messages.authentic_object`); :class:`ValueError` (one line)
    for anything else."""
    data = authentic_object(raw, key)
    data.pop("signature")
    try:
        return _MESSAGE.validate_python(data)
    except ValidationError as error:
        raise ValueError(" ".join(str(error).split())[:300]) from None


def executor_order(executor: str) -> tuple[int, str]:
    """Spark numbers executors in the order they were added: newest sorts last."""
    return (int(executor), executor) if executor.isdigit() else (-1, executor)


def to_release(executors: Sequence[str], wanted: str | None) -> str:
    """The executor a scale-in releases: ``wanted``, or the newest.

    The newest, because it is the one the last scale-out added: the
    executors the job started on keep the state stores they have loaded the
    longest, and a scale-in undoes the last scale-out. The last one is never
    released: a job with no executor runs no batch.
    """
    if len(executors) <= 1:
        raise ExecutorError(
            f"the job has {len(executors)} executor(s); releasing one would leave none "
            "to run its batches"
        )
    if wanted is None:
        return max(executors, key=executor_order)
    if wanted not in executors:
        raise ExecutorError(
            f"executor {wanted!r} is not one of the job's executors {', '.join(executors)}"
        )
    return wanted


class ExecutorChannel:
    """Signed executor commands and replies on the one-partition executors topic."""

    def __init__(self, bootstrap_servers: str, topic: str, key: bytes | str | None = None):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self._key = control_key(key)
        from keyplane.kafka.admin import HighWatermarks
        from keyplane.kafka.producer import LongLivedProducer

        self._sends = LongLivedProducer(bootstrap_servers)
        self._consumer: KafkaConsumer | None = None
        self._marks = HighWatermarks(bootstrap_servers)
        """Kept open: the job's driver asks for the end every few seconds."""

    def ensure(self) -> None:
        from keyplane.kafka.admin import ensure_topic

        ensure_topic(self.bootstrap_servers, self.topic, 1)

    def end(self) -> int:
        return self._marks.of(self.topic, [PARTITION])[PARTITION]

    def earliest(self) -> int:
        from keyplane.kafka.admin import earliest_offsets

        return earliest_offsets(self.bootstrap_servers, self.topic, [PARTITION])[PARTITION]

    def send(self, message: ExecutorCommand | ExecutorReply) -> None:
        """Publish ``message``; a producer the broker refuses is replaced and it is sent again
        (:class:`~keyplane.kafka.producer.LongLivedProducer`): commands and replies are
        matched by request id, so one that arrives twice changes nothing."""
        self._sends.send(
            self.topic, [(None, encode(message, self._key))], partition=PARTITION, timeout_s=30
        )

    def read(
        self, start: int, stop: int | None = None
    ) -> tuple[list[ExecutorCommand | ExecutorReply], int]:
        """The authentic messages from offset ``start`` to ``stop`` (default: the end),
        and the offset after them.

        A record that is not one is logged and skipped: whoever can write the
        topic must not be able to stop the job with it.
        """
        from kafka import KafkaConsumer, TopicPartition

        from keyplane.kafka.security import client_config

        stop = self.end() if stop is None else stop
        if stop <= start:
            return [], start
        partition = TopicPartition(self.topic, PARTITION)
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                **client_config(self.bootstrap_servers),
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=50,
            )
            self._consumer.assign([partition])
        self._consumer.seek(partition, start)
        found: list[ExecutorCommand | ExecutorReply] = []
        position = start
        deadline = time.monotonic() + 30.0
        while position < stop and time.monotonic() < deadline:
            for record in self._consumer.poll(timeout_ms=200).get(partition, []):
                if record.offset >= stop:
                    continue
                try:
                    found.append(decode(record.value or b"", self._key))
                except ValueError as error:
                    log.warning(
                        "executors topic %s, offset %d refused: %s",
                        self.topic,
                        record.offset,
                        error,
                    )
            position = max(position, int(self._consumer.position(partition)))
        return found, min(position, stop)

    def close(self) -> None:
        self._sends.close(timeout_s=10)
        self._marks.close()
        if self._consumer is not None:
            self._consumer.close()
        self._consumer = None


def request(channel: ExecutorChannel, command: ExecutorCommand, timeout_s: float) -> ExecutorReply:
    """The driver's reply to ``command``, sending it only if the topic holds none yet.

    The topic is read from its first record before the command is sent: a
    retried step whose command was answered after its first try gave up
    finds that answer and sends nothing. Replies are then read from where
    that reading ended, so one written meanwhile is not missed. Waits at
    most ``timeout_s``.
    """
    scanned = channel.end()
    position = channel.earliest()
    sent = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        messages, position = channel.read(position)
        for message in messages:
            if isinstance(message, ExecutorReply) and message.request_id == command.request_id:
                if not sent:
                    log.info("executor command %s was answered already", command.request_id)
                return message
        if not sent and position >= scanned:
            channel.send(command)
            sent = True
        time.sleep(0.5 if sent else 0.0)
    if not sent:
        raise ExecutorError(
            f"{channel.topic} could not be read to offset {scanned} within {timeout_s:.0f} s; "
            f"the {command.action} executor command was not sent"
        )
    raise ExecutorError(
        f"the job's driver did not answer the {command.action} executor command on "
        f"{channel.topic} within {timeout_s:.0f} s: is the job running?"
    )


def local_master(master: str) -> bool:
    """Whether ``master`` runs Spark in one process, where executors cannot change."""
    return master.startswith("local")


def registered_executors(sc: SparkContext) -> list[str]:
    """The executors registered with the driver, the driver itself excepted, oldest first."""
    ids = str(sc._jsc.sc().getExecutorIds().mkString(","))
    return sorted((i for i in ids.split(",") if i), key=executor_order)


def hold_executors(sc: SparkContext, count: int) -> None:
    """Ask the cluster manager for ``count`` executors in all, no more."""
    jvm = sc._jvm
    assert jvm is not None
    empty = getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$").empty()
    sc._jsc.sc().requestTotalExecutors(count, 0, empty)


def kill_idle_executors(sc: SparkContext, ids: Sequence[str], adjust_target: bool) -> None:
    """Ask the scheduler backend to kill ``ids`` while they run no task (``force`` off).

    ``adjust_target`` lowers the count asked of the cluster manager by as
    many, so that none replaces them; off, the count held stands.
    ``SparkContext.killExecutors`` would force the kill.
    """
    jvm, gateway = sc._jvm, sc._gateway
    assert jvm is not None and gateway is not None
    from py4j.java_collections import ListConverter

    java_ids = ListConverter().convert(list(ids), gateway._gateway_client)
    seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(java_ids).toSeq()
    sc._jsc.sc().schedulerBackend().killExecutors(seq, adjust_target, False, False)


def surplus(executors: Sequence[str], keep: int) -> list[str]:
    """The executors beyond the ``keep`` oldest: the ones the master granted last."""
    ordered = sorted(executors, key=executor_order)
    return ordered[keep:]


def start_with_executors(
    sc: SparkContext,
    count: int,
    *,
    wait_s: float = 120.0,
    settle_s: float = 5.0,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Hold a new application at ``count`` executors before its query runs a batch.

    A standalone master grants an application executors up to
    ``spark.cores.max`` as soon as it registers, and without dynamic
    allocation nothing limits the first grant. So the driver waits (at most
    ``wait_s``) until ``count`` have registered, holds the application at
    ``count`` and kills the surplus, idle since no batch has run, until
    none has joined for ``settle_s``: the cores they held go back to the
    master for a later scale-out (003 §5). Returns the executors kept;
    fewer than ``count`` when the cluster has no room for more within
    ``wait_s`` (the master grants the rest when a worker frees up).
    """
    deadline = clock() + wait_s
    now = registered_executors(sc)
    while len(now) < count and clock() < deadline:
        time.sleep(poll_s)
        now = registered_executors(sc)
    hold_executors(sc, count)
    settled_at = clock()
    while clock() - settled_at < settle_s and clock() < deadline + settle_s:
        extra = surplus(now, count)
        if extra:
            kill_idle_executors(sc, extra, adjust_target=False)
            settled_at = clock()
        time.sleep(poll_s)
        now = registered_executors(sc)
    if len(now) < count:
        log.warning(
            "%d of the %d initial executors registered within %.0f s; the master grants "
            "the rest when it has room",
            len(now),
            count,
            wait_s,
        )
    return now


class ExecutorControl:
    """The driver's side: carry out the commands of the executors topic on ``sc``.

    ``executors()`` lists the executors registered with the driver, the
    driver itself excepted, in the order Spark added them.

    A command already answered is answered again with the first reply and
    never carried out twice; a refusal is an answer too (a run whose command
    was refused sends no other: a new run does). The answers are kept in
    memory and, when the driver starts, read back from the replies on the
    topic, so this holds across a restart of the job: the run that sent the
    command records that first reply (or finds it, :func:`request`) and rolls
    out on it, and carrying it out again in the new application would change
    its executors without a run saying so. Commands sent before the driver
    started are not carried out; one whose driver died before answering it
    is carried out when its retried step sends it again, since whatever it
    changed ended with that application.
    """

    def __init__(
        self,
        sc: SparkContext,
        channel: ExecutorChannel,
        *,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sc = sc
        self.channel = channel
        self.poll_s = poll_s
        self.clock = clock
        channel.ensure()
        self.position = channel.end()
        """Commands sent before the driver started are not for this driver."""
        self.answered: dict[UUID, ExecutorReply] = {}
        """The reply to each command answered, by command id."""
        start = channel.earliest()
        while start < self.position:
            messages, reached = channel.read(start, self.position)
            if reached <= start:
                from kafka.errors import KafkaTimeoutError

                # A Kafka error: the job's loop logs it and builds the control again later.
                raise KafkaTimeoutError(
                    f"{channel.topic} could not be read from offset {start} to find the "
                    "commands answered already"
                )
            self._remember(messages)
            start = reached

    @property
    def local(self) -> bool:
        return local_master(str(self.sc.master))

    def executors(self) -> list[str]:
        return registered_executors(self.sc)

    def pin(self, count: int | None = None) -> int:
        """Hold the application at ``count`` executors, or at those it has now (see the
        module docstring); any beyond ``count`` is killed once idle."""
        if self.local:
            return 1
        now = self.executors()
        if count is None:
            count = len(now)
        if count:
            hold_executors(self.sc, count)
            extra = surplus(now, count)
            if extra:
                kill_idle_executors(self.sc, extra, adjust_target=False)
        return count

    def _remember(self, messages: Iterable[ExecutorCommand | ExecutorReply]) -> None:
        for message in messages:
            if isinstance(message, ExecutorReply):
                self.answered.setdefault(message.request_id, message)

    def poll(self) -> list[ExecutorReply]:
        """Answer the commands that arrived since the last poll, one after the other."""
        messages, self.position = self.channel.read(self.position)
        replies = []
        for message in messages:
            if isinstance(message, ExecutorReply):
                self._remember([message])
                continue
            reply = self.answered.get(message.request_id)
            if reply is None:
                reply = self.answered[message.request_id] = self.carry_out(message)
            else:
                log.info(
                    "executor command %s was answered already (%s); answering the same",
                    message.request_id,
                    reply.outcome,
                )
            self.channel.send(reply)
            replies.append(reply)
        return replies

    def carry_out(self, command: ExecutorCommand) -> ExecutorReply:
        started = self.clock()
        before = tuple(self.executors())

        def reply(outcome: Literal["applied", "refused"], **fields: object) -> ExecutorReply:
            return ExecutorReply.model_validate(
                {
                    "request_id": command.request_id,
                    "outcome": outcome,
                    "before": before,
                    "after": tuple(self.executors()),
                    "seconds": round(self.clock() - started, 3),
                    **fields,
                }
            )

        if self.local:
            return reply("refused", reason=LOCAL_MODE_REFUSAL)
        try:
            if command.action == "add":
                changed = self._add(before, command.wait_s)
            else:
                changed = self._release(before, command.executor, command.wait_s)
        except ExecutorError as error:
            log.warning("executor command %s refused: %s", command.action, error)
            return reply("refused", reason=str(error)[:500])
        log.info("executor %s: %s; now %s", command.action, changed, self.executors())
        return reply("applied", changed=changed)

    def _add(self, before: Sequence[str], wait_s: float) -> str:
        if not self.sc._jsc.sc().requestExecutors(1):
            raise ExecutorError("the cluster manager refused the request for one more executor")
        new = self._wait(lambda now: sorted(set(now) - set(before), key=executor_order), wait_s)
        if new is None:
            # Withdraw the request, so that no executor the run did not record joins later
            # when a worker frees up.
            hold_executors(self.sc, len(before))
            raise ExecutorError(
                f"no new executor registered within {wait_s:.0f} s: the master has no worker "
                f"with a free core and memory, or spark.cores.max "
                f"({self.sc.getConf().get('spark.cores.max', 'unset')}) leaves no room"
            )
        return new[-1]

    def _release(self, before: Sequence[str], wanted: str | None, wait_s: float) -> str:
        """Release ``gone`` once it runs no task, then wait until it has left.

        The scheduler backend's ``killExecutors`` with ``force`` off kills an
        executor only while it is idle, so no task of a running batch is
        killed and run again; between two micro-batches every executor is
        idle. ``SparkContext.killExecutors`` would force it.
        """
        gone = to_release(before, wanted)

        def killed(now: list[str]) -> list[str]:
            if gone not in now:
                return [gone]
            kill_idle_executors(self.sc, [gone], adjust_target=True)
            return []

        if self._wait(killed, wait_s) is None:
            raise ExecutorError(
                f"executor {gone} was still registered after {wait_s:.0f} s: it never ran "
                "idle long enough to be released"
            )
        return gone

    def _wait(self, found: Callable[[list[str]], list[str]], wait_s: float) -> list[str] | None:
        deadline = self.clock() + wait_s
        while True:
            result = found(self.executors())
            if result:
                return result
            if self.clock() >= deadline:
                return None
            time.sleep(self.poll_s)


def executor_ids(instances: Iterable[str]) -> set[str]:
    """The executor ids in the metrics' ``host:executor`` labels."""
    return {label.rsplit(":", 1)[-1] for label in instances}


class DriverExecutors:
    """The job's driver loop's side of :class:`ExecutorControl`.

    The executor count is pinned once the first batch has run: at
    ``initial`` when the job starts with that many
    (:func:`start_with_executors`), else at the executors that have
    registered by then. Commands are read every ``every_s``. A broker that
    does not answer, or a call Spark refuses, costs a log line, never the job.
    """

    def __init__(
        self,
        spark: SparkSession,
        bootstrap_servers: str,
        control_topic: str,
        every_s: float = 2.0,
        initial: int | None = None,
    ) -> None:
        self.spark = spark
        self.initial = initial
        self.channel = ExecutorChannel(bootstrap_servers, executors_topic(control_topic))
        self.control: ExecutorControl | None = None
        self.every_s = every_s
        self.pinned = False
        self.next_poll = 0.0

    def tick(self, query: StreamingQuery) -> None:
        from kafka.errors import KafkaError
        from py4j.protocol import Py4JError

        from keyplane.kafka.admin import TopicError

        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + self.every_s
        try:
            if self.control is None:
                self.control = ExecutorControl(self.spark.sparkContext, self.channel)
            if not self.pinned and query.lastProgress is not None:
                pinned = self.control.pin(self.initial)
                print(f"keyplane: executors pinned at {pinned}", flush=True)
                self.pinned = True
            for reply in self.control.poll():
                print(
                    f"keyplane: executor command {reply.outcome}: {reply.changed or reply.reason}; "
                    f"executors {', '.join(reply.before)} -> {', '.join(reply.after)}",
                    flush=True,
                )
        except (KafkaError, TopicError, Py4JError) as error:
            log.warning("executor commands not carried out: %s", error)

    def close(self) -> None:
        self.channel.close()

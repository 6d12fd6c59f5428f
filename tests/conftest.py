"""Shared fixtures: a real embedded broker, a real Apache Kafka and a real local SparkSession.

Integration tests use these real components; fakes appear only in unit tests
of pure logic, and such tests say so in their names.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from keyplane.settings import KafkaSource
from keyplane.testing import free_port

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# Control messages are signed (keyplane.control.signing); tests sign with a throwaway key.
os.environ.setdefault("KEYPLANE_CONTROL_KEY", "keyplane-tests-only")
# py4j logs at INFO when its connections are garbage-collected, which for the
# session's SparkSession is at interpreter exit, after pytest has closed the
# streams that Airflow's logging set-up attached to the root logger.
logging.getLogger("py4j").setLevel(logging.WARNING)

# Property tests draw new examples on every local run, to explore; CI
# (HYPOTHESIS_PROFILE=ci, set by .ci/run) draws the same ones from the same
# seed every time, so that a red build is the change's fault and can be re-run.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real embedded broker, shared by the session."""
    from keyplane.kafka.broker import EmbeddedBroker

    home = tmp_path_factory.mktemp("broker")
    embedded = EmbeddedBroker(home, free_port())
    state = embedded.start()
    yield state.bootstrap_servers
    embedded.stop()


@pytest.fixture(scope="session")
def apache_kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real Apache Kafka broker (KRaft, one node), shared by the session.

    Started only by the tests that ask for it (``engine_broker``'s ``kafka``
    case), so a run that selects none of them pays nothing for the JVM.
    """
    from keyplane.kafka.apache_kafka import ApacheKafkaBroker

    home = tmp_path_factory.mktemp("apache-kafka")
    kafka = ApacheKafkaBroker(home, free_port())
    state = kafka.start()
    yield state.bootstrap_servers
    kafka.stop()


@pytest.fixture(
    params=["embedded", pytest.param("kafka", marks=pytest.mark.apache_kafka)],
)
def engine_broker(request: pytest.FixtureRequest) -> str:
    """Bootstrap servers of each engine in turn: the embedded broker, then Apache Kafka.

    For the end-to-end tests that must hold on the broker users run in
    production as well as on the embedded one; ``-m "not apache_kafka"``
    leaves the second out. A test that parametrises it indirectly may add a
    ``kafka-connector`` case: Apache Kafka again, read by Spark's connector
    (:func:`kafka_source`).
    """
    name = "broker" if request.param == "embedded" else "apache_kafka_broker"
    return str(request.getfixturevalue(name))


@pytest.fixture
def kafka_source(request: pytest.FixtureRequest) -> KafkaSource:
    """Who reads the events in this case of a test's ``engine_broker`` (a module's own, or
    the conftest's parametrised indirectly) or ``engine`` parameter: Spark's connector in a
    ``kafka-connector`` case (its events routed in the JVM, its batches' routing read back
    from Spark's offset log), keyplane's source otherwise."""
    params = request.node.callspec.params
    connector = "kafka-connector" in (params.get("engine_broker"), params.get("engine"))
    return "jvm" if connector else "python"


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    from keyplane.spark.session import build_session

    session = build_session("keyplane-tests", "local[2]", shuffle_partitions=4)
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _no_idle_consumers_outlive_their_test() -> Iterator[None]:
    """Close the consumers a test's reads left idle in this process's pool.

    The pool (keyplane.kafka.consumers) keeps them for the next read, which
    in a test process may belong to another test and another broker. An
    idle consumer of a broker its test has stopped reconnects forever on a
    thread of its own, drawing its back-off jitter from the ``random``
    module while later tests run (Hypothesis warns when that happens during
    its draws), so each test starts with an empty pool.
    """
    yield
    from keyplane.kafka.consumers import close_idle

    close_idle()


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic of this test's own, named after it: at most 82 characters, a long name cut
    and ended by a hash of the whole, so that two cases of a long-named test sharing a
    broker (``kafka`` and ``kafka-connector``) do not share their topics."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")
    if len(name) > 80:
        name = name[:71] + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return "t-" + name


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


_LEFT_RUNNING = pytest.StashKey[list[str]]()


def _spark_gateway_pids() -> set[int]:
    """The in-process session's JVM and its children: Spark stops them itself at exit."""
    import psutil
    from pyspark import SparkContext

    gateway = getattr(SparkContext, "_gateway", None)
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return set()
    try:
        jvm = psutil.Process(proc.pid)
        return {jvm.pid, *(child.pid for child in jvm.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _close_open_kafka_clients() -> list[str]:
    """Close the Kafka clients a test left open, while their I/O threads still run.

    Closed at interpreter exit instead, a client may wait on an I/O thread
    that finalization has already stopped.
    """
    import gc

    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    named = []
    kinds = (KafkaProducer, KafkaConsumer, KafkaAdminClient)
    for client in gc.get_objects():
        # type(), not isinstance(): the latter reads ``__class__``, which some
        # lazy proxies in memory (Airflow's) answer by importing a module.
        if not issubclass(type(client), kinds):
            continue
        if getattr(client, "_closed", True):
            continue
        named.append(f"open {type(client).__name__}")
        try:
            if isinstance(client, KafkaProducer):
                client.close(timeout=5)
            elif isinstance(client, KafkaConsumer):
                client.close(autocommit=False, timeout_ms=5_000)
            else:
                client.close()
        except Exception as exc:  # reported, and the run still ends
            named.append(f"  could not close it: {exc!r}")
    return named


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close what the tests left open, kill what they left running; name both in the summary.

    A test that fails between starting a process (a job, a CLI, a server)
    and stopping it leaves that process behind; one that still holds the
    output of the run keeps the run from ending long after its last test.
    """
    import psutil

    from keyplane.kafka.consumers import close_idle

    close_idle()  # the process's idle lent consumers stay open on purpose; not a leak
    named = _close_open_kafka_clients()

    spark_owned = _spark_gateway_pids()
    left = [
        child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in spark_owned and child.is_running()
    ]
    for child in left:
        try:
            named.append(f"{child.pid}: {' '.join(child.cmdline())[:200]}")
            child.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=10)
    session.config.stash[_LEFT_RUNNING] = named


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    named = config.stash.get(_LEFT_RUNNING, [])
    if named:
        terminalreporter.section("left open or running by tests (closed, killed)", yellow=True)
        for line in named:
            terminalreporter.line(line)

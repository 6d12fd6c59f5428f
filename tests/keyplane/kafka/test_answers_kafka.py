"""``answers_kafka`` asked where no Kafka answers: no socket, no client thread left behind.

The probe runs wherever keyplane waits for or checks a broker: while the
embedded broker starts (its first probes may find the port still closed),
before the job starts, and on every dashboard read of the metrics topic, which
a stopped broker turns into a failed probe every 10 s for as long as the
api-server runs. A socket left to the garbage collector shows as a
ResourceWarning in whichever later test the collector happens to run; a
client's I/O thread left running is never reclaimed at all.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from keyplane.kafka.broker import answers_kafka
from keyplane.testing import free_port


@contextmanager
def _nothing_left_behind() -> Iterator[None]:
    """Fail when the block leaves a thread running or an unclosed socket to the collector.

    The Kafka client's own log is muted meanwhile: pytest keeps a test's log
    records, and the record of a failed connection holds the exception, whose
    traceback holds the socket, so the collector would only find it after the
    test, in another one.
    """
    kafka_log = logging.getLogger("kafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    gc.collect()  # what earlier tests left is theirs
    before = set(threading.enumerate())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            yield
            gc.collect()
    finally:
        kafka_log.setLevel(level)
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert [t.name for t in threading.enumerate() if t not in before and t.is_alive()] == []


def test_a_port_nobody_listens_on_does_not_answer_and_leaves_nothing_open() -> None:
    with _nothing_left_behind():
        assert not answers_kafka(f"127.0.0.1:{free_port()}", timeout_s=1.0)


def test_a_listener_that_never_answers_kafka_leaves_no_client_running() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with _nothing_left_behind():
            assert not answers_kafka(f"127.0.0.1:{port}", timeout_s=0.5)

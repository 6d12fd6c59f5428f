"""Apache Kafka, one KRaft node: :class:`~keyplane.kafka.apache_kafka.ApacheKafkaBroker`.

``up`` creates the events and results topics as ``docker-compose.yml``'s
``kafka-init`` does; the routed job creates its one-partition protocol topics.

On loopback for this machine's processes; with shaped links, a second
listener on the bridge for the executors, which reach this machine only
through their links.
"""

from __future__ import annotations

from pathlib import Path

from keyplane.kafka.admin import ensure_topic
from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import BrokerError, answers_kafka
from keyplane.stack.piece import Health, StackError


class KafkaPiece:
    name = "kafka"

    def __init__(
        self,
        home: Path,
        port: int,
        external: tuple[str, int] | None,
        topics: tuple[str, ...] = (),
        partitions: int = 8,
    ) -> None:
        self.topics = topics
        self.partitions = partitions
        self.broker = ApacheKafkaBroker(home / "kafka", port=port, external=external)
        self.bootstrap_servers = (
            f"127.0.0.1:{port}" if external is None else f"{external[0]}:{external[1]}"
        )

    @property
    def log(self) -> Path:
        return self.broker.home / "broker.log"

    def up(self) -> None:
        if self.broker.status() is None or not answers_kafka(self.bootstrap_servers):
            self._start()
        for topic in self.topics:
            ensure_topic(self.bootstrap_servers, topic, self.partitions)

    def _start(self) -> None:
        try:
            self.broker.start()
        except BrokerError as error:
            raise StackError(f"kafka did not come up: {error}") from None
        if not answers_kafka(self.bootstrap_servers, timeout_s=10.0):
            raise StackError(
                f"kafka did not answer metadata at {self.bootstrap_servers}; see {self.log}"
            )

    def down(self) -> bool:
        try:
            return self.broker.stop()
        except BrokerError as error:
            raise StackError(f"kafka: {error}") from None

    def health(self) -> Health:
        up = answers_kafka(self.bootstrap_servers)
        return Health(
            piece=self.name,
            up=up,
            url=self.bootstrap_servers,
            detail="answers metadata" if up else f"no answer; log {self.log}",
        )

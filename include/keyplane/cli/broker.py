"""``keyplane broker start|stop|status``: the local broker, embedded or Apache Kafka."""

from __future__ import annotations

import argparse
import sys

from keyplane.kafka.apache_kafka import ApacheKafkaBroker
from keyplane.kafka.broker import BrokerError, BrokerState, EmbeddedBroker, answers_kafka
from keyplane.settings import Settings


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

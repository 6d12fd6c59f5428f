"""The control topic as an in-memory list, and the job's replies on it, for in-process tests.

The controller, the protocol, its state file and the configuration store the
tests drive are the real ones; only the topic is a list
(:class:`FakeControlTopic`), and the job's replies are appended to it by hand
(:func:`reply`). Tests on it say "fake" in their names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keyplane.control.messages import ControlMessage
from keyplane.kafka.control import ControlRead
from keyplane.orchestration import rollout_steps
from keyplane.orchestration.deployment import Deployment
from keyplane.routing import config as config_store


class FakeControlTopic:
    """The control topic as a list: every channel a test opens reads and appends to it."""

    def __init__(self) -> None:
        self.messages: list[ControlMessage] = []
        self.sends: list[int] = []
        """How many messages each send published, in order."""

    def channel(self, bootstrap_servers: str, topic: str, **_: Any) -> FakeControlChannel:
        return FakeControlChannel(self, topic)

    def sent(self, start: int = 0) -> list[str]:
        """The messages from ``start`` on, as ``sender:TYPE vN``."""
        return [f"{m.sender}:{m.type} v{m.config_version}" for m in self.messages[start:]]


class FakeControlChannel:
    """:class:`keyplane.kafka.control.ControlChannel`'s methods the controller calls."""

    def __init__(self, log: FakeControlTopic, topic: str) -> None:
        self.log = log
        self.topic = topic

    def ensure(self) -> None:
        pass

    def end_offset(self) -> int:
        return len(self.log.messages)

    def send(self, messages: Sequence[ControlMessage]) -> None:
        self.log.messages.extend(messages)
        self.log.sends.append(len(messages))

    def read(self, start: int, end: int | None = None) -> ControlRead:
        stop = len(self.log.messages) if end is None else end
        return ControlRead(tuple((i, self.log.messages[i]) for i in range(start, stop)), (), stop)

    def close(self) -> None:
        pass

    def __enter__(self) -> FakeControlChannel:
        return self

    def __exit__(self, *_: object) -> None:
        pass


class FakeTaskInstance:
    """The task instance in a task's context, as far as the waits use it: XCom."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids, [])


def prepare(deployment: Deployment, version: int) -> None:
    with rollout_steps.controller(deployment) as controller:
        controller.prepare(version)


def reply(
    topic: FakeControlTopic, deployment: Deployment, kind: str, version: int, operator: str = "A"
) -> None:
    """The job's ACK (or ``operator``'s MIGRATED) for ``version``, as the job would send it."""
    topic.messages.append(
        ControlMessage(
            type=kind,
            config_version=version,
            operator=operator if kind == "MIGRATED" else None,
            checksum=config_store.checksum(deployment.routing_store, version),
            sender="job",
            batch_id=7,
        )
    )


def in_flight(deployment: Deployment) -> int | None:
    with rollout_steps.controller(deployment) as controller:
        return controller.in_flight


def write_record(folder: Path, name: str, record: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(record))


def decide_scale_in_of_b(deployment: Deployment, run_id: str) -> None:
    """The scale run's decision record: scale B in from four instances to two."""
    from keyplane.control.operators import OPERATORS
    from keyplane.orchestration import scale_steps

    write_record(
        scale_steps._folder(deployment, run_id),
        scale_steps.DECISION,
        {
            "publish": True,
            "reason": "scale B in",
            "operator": "B",
            "parent_version": 1,
            "active_before": {name: [0, 1, 2, 3] for name in OPERATORS},
            "active_after": {"A": [0, 1, 2, 3], "B": [0, 1]},
        },
    )


def roll_out(topic: FakeControlTopic, deployment: Deployment, version: int) -> None:
    """PREPARE → ACK → PROPAGATE → MIGRATED → DONE of ``version``, the job answering at once."""
    prepare(deployment, version)
    reply(topic, deployment, "ACK", version)
    with rollout_steps.controller(deployment) as controller:
        controller.propagate_all(["A", "B"], version=version)
        reply(topic, deployment, "MIGRATED", version, "A")
        reply(topic, deployment, "MIGRATED", version, "B")
        controller.done(version=version)

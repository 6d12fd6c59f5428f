"""Control messages as the controller and the job exchange them, for the dashboard's tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keyplane.control.messages import ControlMessage

T0 = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
"""When every test rollout starts."""


def control_message(kind: str, version: int, at: float, **extra: object) -> ControlMessage:
    """A ``kind`` message for ``version``, sent ``at`` seconds after :data:`T0` by the side
    that sends that kind."""
    job = kind in ("ACK", "MIGRATED")
    return ControlMessage.model_validate(
        {
            "type": kind,
            "config_version": version,
            "checksum": "c",
            "sender": "job" if job else "controller",
            "sent_at": T0 + timedelta(seconds=at),
            **({"batch_id": 1} if job else {}),
            **extra,
        }
    )

"""``keyplane status``: one screen for the broker, the job, its versions, lag and rollout."""

from __future__ import annotations

import argparse

from keyplane.cli.display import _duration, _job_line, _line, _rollout_line, _since, _versions
from keyplane.kafka.broker import EmbeddedBroker, answers_kafka
from keyplane.settings import Settings
from keyplane.spark.job_record import describe_aggregates
from keyplane.spark.jobprocess import JobProcess


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

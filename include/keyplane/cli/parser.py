"""The command line's grammar: every command, its options and their help."""

from __future__ import annotations

import argparse
from pathlib import Path

from keyplane.cli.airflow import cmd_airflow
from keyplane.cli.arguments import (
    _TOPIC_NAME_HELP,
    _count,
    _port,
    _rate,
    _seconds,
    _seconds_or_zero,
    _topic,
    _version,
)
from keyplane.cli.broker import cmd_broker
from keyplane.cli.config import cmd_config
from keyplane.cli.job import cmd_job
from keyplane.cli.stack import cmd_stack
from keyplane.cli.status import cmd_status
from keyplane.cli.topic import cmd_topic
from keyplane.cli.workloads import WORKLOADS, _add_model_options, cmd_demo, cmd_generate
from keyplane.reference.events import FORWARD_MODES, MAX_EVENT_BYTES
from keyplane.settings import STAGE_ENGINES
from keyplane.spark.jobprocess import START_TIMEOUT_S, STOP_TIMEOUT_S, WAIT_TIMEOUT_S


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyplane",
        description="Control plane for stateful Spark Structured Streaming jobs: "
        "locality-aware routing, hot-key splitting and live state migration.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = sub.add_parser(
        "broker", help="start, stop or inspect the local broker (embedded, or Apache Kafka)"
    )
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument(
        "--port",
        type=_port,
        help="loopback port, 1 to 65535 (default: KEYPLANE_BROKER_PORT or 19092)",
    )
    broker.add_argument(
        "--storage",
        choices=["memory", "s3"],
        help="start: 'memory' (lost on stop) or 's3' (durable; default: KEYPLANE_BROKER_STORAGE "
        "or memory)",
    )
    broker.add_argument(
        "--allow-memory",
        action="store_true",
        help="start: start on memory storage even in a home whose last broker used s3 "
        "(an empty broker: that broker's topics stay in the object store)",
    )
    broker.add_argument(
        "--engine",
        choices=["embedded", "kafka"],
        help="'embedded' (no JVM, starts at once) or 'kafka': Apache Kafka, its logs kept under "
        "KEYPLANE_HOME/kafka (default: KEYPLANE_BROKER_ENGINE or embedded)",
    )
    broker.set_defaults(func=cmd_broker)

    topic = sub.add_parser("topic", help="create a topic or count its records")
    topic.add_argument("action", choices=["create", "describe"])
    topic.add_argument("name", type=_topic, help=_TOPIC_NAME_HELP)
    topic.add_argument(
        "--partitions",
        type=_count,
        default=8,
        help="partitions to create, 1 or more; an existing topic keeps its own (default: 8)",
    )
    topic.set_defaults(func=cmd_topic)

    for name, help_text, func in (
        ("generate", "write a generated workload to a Kafka topic", cmd_generate),
        ("demo", "run the main job end to end: broker, routed job, reconfiguration DAG", cmd_demo),
    ):
        cmd = sub.add_parser(name, help=help_text)
        kinds = cmd.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
        for kind, model in WORKLOADS.items():
            k = kinds.add_parser(kind, help=(model.__doc__ or "").strip().splitlines()[0])
            _add_model_options(k, model)
            k.add_argument(
                "--partitions",
                type=_count,
                default=8,
                help="topic partitions, 1 or more; an existing topic keeps its own (default: 8)",
            )
            k.add_argument(
                "--rate",
                type=_rate,
                default=None if name == "generate" else 20_000.0,
                help="events per second, a positive number (default: unlimited for generate, "
                "20000 for demo)",
            )
            if name == "generate":
                k.add_argument(
                    "--topic",
                    type=_topic,
                    help=f"target topic, {_TOPIC_NAME_HELP} (default: KEYPLANE_EVENTS_TOPIC)",
                )
            else:
                k.add_argument(
                    "--max-offsets-per-trigger",
                    type=_count,
                    default=20_000,
                    help="events per micro-batch at most (default: 20000)",
                )
        cmd.set_defaults(func=func)

    job = sub.add_parser(
        "job", help="start, stop or inspect the routed streaming job, a background process"
    )
    job_actions = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    job_start = job_actions.add_parser(
        "start",
        help="launch the routed job in the background (pid file and log in "
        "KEYPLANE_HOME/job) and wait until it is up; a running job is left alone, and "
        "options it does not run with are refused",
    )
    job_start.add_argument(
        "--pipeline",
        metavar="MODULE:ATTR",
        help="the job's pipeline (keyplane.Pipeline, or a function that returns one); its "
        "stages are fixed for the life of the checkpoint (default: KEYPLANE_PIPELINE, the "
        "reference two-stage count)",
    )
    job_start.add_argument(
        "--shuffle-partitions",
        type=_count,
        help="instances of each stateful operator (default: the checkpoint's on a restart, "
        "else the newest stored configuration's, else 4); a number that differs from "
        "either is refused",
    )
    job_start.add_argument(
        "--max-offsets-per-trigger",
        type=_count,
        help="events per micro-batch at most (default: every event available)",
    )
    job_start.add_argument(
        "--master", help="Spark master URL (default: KEYPLANE_SPARK_MASTER or local[2])"
    )
    for stage, keyed_by in (("a", "field 1, gets field 2"), ("b", "field 2, gets field 1")):
        job_start.add_argument(
            f"--stage-{stage}-aggregate",
            metavar="MODULE:ATTR",
            help=f"stage {stage.upper()}'s keyed aggregate (keyed by {keyed_by}), a "
            "keyplane.aggregates.KeyedAggregate instance or class; fixed for the life of the "
            "checkpoint (default: the running count)",
        )
    job_start.add_argument(
        "--forward",
        choices=FORWARD_MODES,
        help="what stage A sends stage B: one row per (field-1, field-2) pair and micro-batch "
        "with its weight (pairs), or every tuple with its padding, so the shuffle between the "
        "stages carries the tuples (tuples) (default: pairs)",
    )
    job_start.add_argument(
        "--max-event-bytes",
        type=_count,
        help="the largest event record the job parses, in bytes; a larger one goes to the "
        "dead-letter topic as 'oversized'; the statistics should use the same bound, so set "
        f"KEYPLANE_MAX_EVENT_BYTES instead where they run (default: it, or {MAX_EVENT_BYTES:,})",
    )
    job_start.add_argument(
        "--stage-engine",
        choices=STAGE_ENGINES,
        default="auto",
        help="where the stages run: jvm (Java stateful processors, the running count only) or "
        "python (any aggregate), both for the reference pipeline's two stages; chain (any "
        "pipeline of 1 to N stages); or auto (the JVM when both stages run the running count, "
        "the chain for a pipeline of another shape); fixed for the life of the checkpoint "
        "(default: auto, or the checkpoint's own)",
    )
    job_start.add_argument(
        "--restarts",
        type=int,
        help="start the query again from its checkpoint, in the same process, up to this many "
        "times after it fails (a broker down past the producers' delivery timeout, a failed "
        "task); the failed batch is replayed exactly (default: 0, the job ends)",
    )
    job_start.add_argument(
        "--restart-delay",
        type=_seconds_or_zero,
        help="wait this long before each restart, so that a broker can return; 0: restart at "
        "once (default: 10)",
    )
    job_start.add_argument(
        "--timeout",
        type=_seconds,
        default=START_TIMEOUT_S,
        help="seconds to wait for the job to be up (its first micro-batch, or its query "
        "running when there are no events to read) before stopping it "
        f"(default: {START_TIMEOUT_S:.0f})",
    )
    job_stop = job_actions.add_parser(
        "stop", help="stop the job cleanly between micro-batches (SIGTERM, then SIGKILL)"
    )
    job_stop.add_argument(
        "--timeout",
        type=_seconds,
        default=STOP_TIMEOUT_S,
        help=f"seconds to wait for a clean stop before SIGKILL (default: {STOP_TIMEOUT_S:.0f})",
    )
    job_wait = job_actions.add_parser(
        "wait",
        help="wait until the running job has read every event on its topic (exit 1: it is not "
        "running, or it did not catch up in time)",
    )
    job_wait.add_argument(
        "--timeout",
        type=_seconds,
        default=WAIT_TIMEOUT_S,
        help=f"seconds to wait at most (default: {WAIT_TIMEOUT_S:.0f})",
    )
    job_actions.add_parser(
        "status",
        help="running or not; routing versions, last batch, rows/s, lag, locality, "
        "imbalance from the metrics topic; the controller's rollout (exit 1: not running)",
    )
    job.set_defaults(func=cmd_job)

    overview = sub.add_parser(
        "status",
        help="one screen: broker up, job running, active routing versions, lag, last rollout "
        "(exit 1 unless broker and job both run)",
    )
    overview.set_defaults(func=cmd_status)

    airflow = sub.add_parser(
        "airflow",
        help="run Airflow (UI, scheduler, dag processor, triggerer) on this project's DAGs and "
        "dashboard plugin; prints the URL and how to log in",
    )
    airflow.add_argument(
        "--port", type=_port, default=8080, help="port of the UI and API (default: 8080)"
    )
    airflow.add_argument(
        "--parallelism",
        type=_count,
        default=4,
        help="task slots of the LocalExecutor (default: 4, for a small machine)",
    )
    airflow.add_argument("--dags-folder", type=Path, help="default: the project's dags/")
    airflow.add_argument("--plugins-folder", type=Path, help="default: the project's plugins/")
    airflow.set_defaults(func=cmd_airflow)

    stack = sub.add_parser(
        "stack",
        help="production on one machine: Apache Kafka, a Spark standalone master and workers "
        "(on shaped links where namespaces can be made), PostgreSQL, Airflow's four components "
        "and the routed job; up, down, or each piece's status (exit 1 unless all are up)",
    )
    stack.add_argument("action", choices=("up", "down", "status"))
    stack.add_argument(
        "--without-job", action="store_true", help="up: everything but the routed job"
    )
    stack.set_defaults(func=cmd_stack)

    configs = sub.add_parser(
        "config", help="show or diff stored routing configurations; publish one live or abort it"
    )
    actions = configs.add_subparsers(dest="action", required=True, metavar="ACTION")
    store_help = "configuration store (default: KEYPLANE_HOME/configs)"
    show = actions.add_parser(
        "show", help="a version's lineage, checksum, tables and hot keys per operator"
    )
    show.add_argument(
        "version",
        nargs="?",
        type=_version,
        help="version to show (default: the active one, the controller's; before any rollout "
        "the newest version that was not planned and left unpublished)",
    )
    show.add_argument("--store", type=Path, help=store_help)
    listing = actions.add_parser(
        "list", help="stored versions, newest first, with their parent, origin and status"
    )
    listing.add_argument(
        "--all",
        action="store_true",
        help="also the versions a run planned but did not publish",
    )
    listing.add_argument("--store", type=Path, help=store_help)
    diff = actions.add_parser(
        "diff", help="the keys, hot keys and state transfers that going from OLD to NEW moves"
    )
    diff.add_argument("a", metavar="OLD", type=_version, help="the version replaced")
    diff.add_argument("b", metavar="NEW", type=_version, help="the version replacing it")
    diff.add_argument("--store", type=Path, help=store_help)
    diff.add_argument(
        "--statistics",
        type=Path,
        help="statistics snapshots to score both versions on, for the expected gain "
        "(default: KEYPLANE_HOME/statistics)",
    )
    publish = actions.add_parser(
        "publish",
        help="store a configuration file and roll it out to the running job, operator by operator",
    )
    publish.add_argument(
        "file",
        metavar="FILE",
        type=Path,
        help="a routing configuration as JSON; it carries its version and parent_version",
    )
    publish.add_argument("--store", type=Path, help=store_help)
    publish.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        help="seconds to wait for each reply of the job before aborting (default: 120)",
    )
    publish.add_argument(
        "--max-moves-per-wave",
        type=_count,
        metavar="N",
        help="roll the change out in waves that each move at most N keys, numbered from "
        "FILE's version on: a smaller dip in throughput over more micro-batches",
    )
    publish.add_argument(
        "--no-job-check",
        action="store_true",
        help="skip the checks against the job of KEYPLANE_HOME (that it runs, its state "
        "partitions and operators), for a job started elsewhere; the job still refuses a "
        "version it cannot take",
    )
    publish.add_argument(
        "--no-wait",
        action="store_true",
        help="store and send PREPARE only; the same command without it finishes the rollout",
    )
    abort = actions.add_parser(
        "abort", help="abort the rollout in flight: the job goes back to its active version"
    )
    abort.add_argument("--store", type=Path, help=store_help)
    configs.set_defaults(func=cmd_config)
    return parser

"""``keyplane``: the command line of the control plane.

Every long step shows a progress bar; every failure exits non-zero with one
line that says what went wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from tqdm import tqdm

from keyplane import config as config_store
from keyplane.config_report import render_config, render_diff
from keyplane.kafka.admin import TopicError, ensure_topic, high_watermarks
from keyplane.kafka.broker import BrokerError, EmbeddedBroker
from keyplane.kafka.producer import produce_workload
from keyplane.settings import Settings
from keyplane.workloads import GeoTagsWorkload, PairsWorkload, ZipfEvolvingWorkload

WORKLOADS: dict[str, type[BaseModel]] = {
    "pairs": PairsWorkload,
    "zipf-evolving": ZipfEvolvingWorkload,
    "geo-tags": GeoTagsWorkload,
}


class CliError(RuntimeError):
    """A user-facing error: printed as one line, exit status 2."""


def _add_model_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One ``--option`` per field of a workload spec, with its description."""
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        default = field.default
        help_text = f"{field.description or ''} (default: {default})"
        if origin is tuple:
            parser.add_argument(flag, dest=name, type=float, nargs="+", help=help_text)
        else:
            scalar = args[0] if args else annotation
            convert: Callable[[str], Any] = str
            if scalar is int:
                convert = int
            elif scalar is float:
                convert = float
            parser.add_argument(flag, dest=name, type=convert, help=help_text)


def _spec_from_args(kind: str, args: argparse.Namespace) -> Any:
    model = WORKLOADS[kind]
    values = {
        name: getattr(args, name)
        for name in model.model_fields
        if name != "kind" and getattr(args, name, None) is not None
    }
    return model(kind=kind, **values)


def _broker(settings: Settings, args: argparse.Namespace) -> EmbeddedBroker:
    return EmbeddedBroker(settings.home, args.port or settings.broker_port)


def cmd_broker(settings: Settings, args: argparse.Namespace) -> int:
    broker = _broker(settings, args)
    if args.action == "start":
        state = broker.start()
        print(f"broker running on {state.bootstrap_servers} (pid {state.pid}, log {state.log})")
    elif args.action == "stop":
        print("broker stopped" if broker.stop() else "no broker was running")
    else:
        running = broker.status()
        if running is None:
            print("broker: not running")
            return 1
        print(f"broker: running on {running.bootstrap_servers} (pid {running.pid})")
    return 0


def cmd_topic(settings: Settings, args: argparse.Namespace) -> int:
    bootstrap = settings.resolved_bootstrap_servers()
    if args.action == "create":
        n = ensure_topic(bootstrap, args.name, args.partitions)
        print(f"topic {args.name}: {n} partitions")
    else:
        marks = high_watermarks(bootstrap, args.name)
        print(f"topic {args.name}: {sum(marks.values()):,} records in {len(marks)} partitions")
    return 0


def cmd_generate(settings: Settings, args: argparse.Namespace) -> int:
    spec = _spec_from_args(args.workload, args)
    topic = args.topic or settings.events_topic
    with tqdm(
        total=spec.n_events, desc=f"generate {args.workload}", unit="ev", unit_scale=True
    ) as bar:
        sent = produce_workload(
            spec,
            settings.resolved_bootstrap_servers(),
            topic,
            partitions=args.partitions,
            rate=args.rate,
            on_progress=bar.update,
        )
    print(f"sent {sent:,} events to {topic}")
    return 0


def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from keyplane.demo import run_demo

    spec = _spec_from_args(args.workload, args)
    result = run_demo(
        spec,
        settings,
        rate=args.rate,
        partitions=args.partitions,
        max_offsets_per_trigger=args.max_offsets_per_trigger,
    )
    return 0 if result.report.exact else 1


def _config_store(settings: Settings, args: argparse.Namespace) -> tuple[Path, list[int]]:
    """The store to read and its versions, refusing an empty store up front: "no
    version 3" would send the user looking for a version when none was ever published."""
    store: Path = args.store or settings.config_store
    versions = config_store.stored_versions(store)
    if not versions:
        raise CliError(f"no configuration stored in {store}; publish one first")
    return store, versions


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    store, versions = _config_store(settings, args)
    if args.action == "show":
        version = args.version or versions[-1]
        shown = config_store.load(store, version)
        print(render_config(shown, config_store.checksum(store, version)))
        return 0
    old = config_store.load(store, args.a)
    new = config_store.load(store, args.b)
    if set(old.operators) != set(new.operators):
        raise CliError(
            f"versions {args.a} and {args.b} route different operators "
            f"({', '.join(old.operators)} vs {', '.join(new.operators)}); "
            "diff two versions of the same pipeline"
        )
    print(render_diff(old, new))
    return 0


def _config_error_line(error: config_store.ConfigStoreError) -> str:
    """The store's message plus what to do about it, on one line."""
    if isinstance(error, config_store.UnknownVersionError):
        fix = "pass one of the stored versions"
    elif isinstance(error, config_store.ChecksumMismatchError):
        fix = "restore the file from a backup or publish a new version"
    else:
        fix = "check the store directory or publish a new version"
    return f"keyplane: {error}; {fix}".replace("\n", " ")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyplane",
        description="Control plane for stateful Spark Structured Streaming jobs: "
        "locality-aware routing, hot-key splitting and live state migration.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = sub.add_parser("broker", help="start, stop or inspect the embedded Kafka broker")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument(
        "--port", type=int, help="loopback port (default: KEYPLANE_BROKER_PORT or 19092)"
    )
    broker.set_defaults(func=cmd_broker)

    topic = sub.add_parser("topic", help="create a topic or count its records")
    topic.add_argument("action", choices=["create", "describe"])
    topic.add_argument("name")
    topic.add_argument(
        "--partitions", type=int, default=8, help="partitions to create (default: 8)"
    )
    topic.set_defaults(func=cmd_topic)

    for name, help_text, func in (
        ("generate", "write a generated workload to a Kafka topic", cmd_generate),
        ("demo", "run the main job end to end on the embedded broker and local Spark", cmd_demo),
    ):
        cmd = sub.add_parser(name, help=help_text)
        kinds = cmd.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
        for kind, model in WORKLOADS.items():
            k = kinds.add_parser(kind, help=(model.__doc__ or "").strip().splitlines()[0])
            _add_model_options(k, model)
            k.add_argument(
                "--partitions", type=int, default=8, help="topic partitions (default: 8)"
            )
            k.add_argument(
                "--rate",
                type=float,
                default=None if name == "generate" else 20_000.0,
                help="events per second (default: unlimited for generate, 20000 for demo)",
            )
            if name == "generate":
                k.add_argument("--topic", help="target topic (default: KEYPLANE_EVENTS_TOPIC)")
            else:
                k.add_argument(
                    "--max-offsets-per-trigger",
                    type=int,
                    default=20_000,
                    help="events per micro-batch at most (default: 20000)",
                )
        cmd.set_defaults(func=func)

    configs = sub.add_parser("config", help="show a stored routing configuration or diff two")
    actions = configs.add_subparsers(dest="action", required=True, metavar="ACTION")
    store_help = "configuration store (default: KEYPLANE_HOME/configs)"
    show = actions.add_parser(
        "show", help="a version's lineage, checksum, tables and hot keys per operator"
    )
    show.add_argument(
        "version", nargs="?", type=_version, help="version to show (default: the latest)"
    )
    show.add_argument("--store", type=Path, help=store_help)
    diff = actions.add_parser(
        "diff", help="the keys, hot keys and state transfers that going from A to B moves"
    )
    diff.add_argument("a", metavar="A", type=_version, help="the version replaced")
    diff.add_argument("b", metavar="B", type=_version, help="the version replacing it")
    diff.add_argument("--store", type=Path, help=store_help)
    configs.set_defaults(func=cmd_config)
    return parser


def _version(text: str) -> int:
    """A version number as stored: an integer from 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version (an integer from 1)")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings()
        return int(args.func(settings, args))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "input"
        print(f"keyplane: invalid {where}: {first['msg']}", file=sys.stderr)
    except (BrokerError, TopicError, CliError) as exc:
        print(f"keyplane: {exc}", file=sys.stderr)
    except config_store.ConfigStoreError as exc:
        print(_config_error_line(exc), file=sys.stderr)
    except KeyboardInterrupt:
        print("keyplane: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())

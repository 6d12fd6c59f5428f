"""``keyplane generate`` and ``keyplane demo``: the commands that take a generated workload,
with one option per field of its spec."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from keyplane.cli.errors import CliError
from keyplane.cli.topic import _ensure_topic
from keyplane.kafka.producer import WorkloadNotDelivered, produce_workload
from keyplane.reference.workloads import GeoTagsWorkload, PairsWorkload, ZipfEvolvingWorkload
from keyplane.settings import Settings
from keyplane.util.progressbars import progress_bar

WORKLOADS: dict[str, type[BaseModel]] = {
    "pairs": PairsWorkload,
    "zipf-evolving": ZipfEvolvingWorkload,
    "geo-tags": GeoTagsWorkload,
}


def _add_model_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One ``--option`` per field of a workload spec, with its description.

    An option not given is left out of the namespace (``SUPPRESS``), so that
    the spec's own default applies and ``none`` given to an optional integer
    (``--flash-every none``) can still reach the spec as None.
    """
    for name, field in model.model_fields.items():
        if name == "kind":
            continue
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        default = field.default
        bounds = "".join(f", at most {m.le:,}" for m in field.metadata if hasattr(m, "le"))
        help_text = f"{field.description or ''} (default: {default}{bounds})"
        unset = argparse.SUPPRESS
        if origin is tuple:
            parser.add_argument(
                flag, dest=name, type=float, nargs="+", default=unset, help=help_text
            )
        elif annotation is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=unset,
                help=help_text,
            )
        else:
            scalar = args[0] if args else annotation
            convert: Callable[[str], Any] = str
            if scalar is int:
                convert = _int_or_none if type(None) in typing.get_args(annotation) else int
            elif scalar is float:
                convert = float
            parser.add_argument(flag, dest=name, type=convert, default=unset, help=help_text)


def _int_or_none(text: str) -> int | None:
    """An argparse type for an optional integer field: ``none`` (any case) is None."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'none'") from None


def _spec_from_args(kind: str, args: argparse.Namespace) -> Any:
    model = WORKLOADS[kind]
    given = vars(args)
    values = {name: given[name] for name in model.model_fields if name != "kind" and name in given}
    return model(kind=kind, **values)


def cmd_generate(settings: Settings, args: argparse.Namespace) -> int:
    spec = _spec_from_args(args.workload, args)
    topic = settings.events_topic if args.topic is None else args.topic
    bootstrap = settings.resolved_bootstrap_servers()
    n_parts = _ensure_topic(bootstrap, topic, args.partitions)
    with progress_bar(
        total=spec.n_events, desc=f"generate {args.workload}", unit="ev", unit_scale=True
    ) as bar:
        try:
            sent = produce_workload(
                spec,
                bootstrap,
                topic,
                partitions=args.partitions,
                topic_partitions=n_parts,
                rate=args.rate,
                on_progress=bar.update,
            )
        except WorkloadNotDelivered as exc:
            raise CliError(
                f"{exc}; see what the topic holds with `keyplane topic describe {topic}`"
            ) from None
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
    return 0 if result.succeeded else 1

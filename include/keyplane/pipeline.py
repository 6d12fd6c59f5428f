"""Pipelines: the streaming job a user declares and keyplane runs and steers.

A pipeline reads one value format from Kafka topics and runs a chain of 1
to N keyed stages. Every stage sees every event: it takes the event's key
(a Spark SQL expression over the parsed value), feeds the event's value to
its :class:`~keyplane.aggregates.KeyedAggregate`, and hands the event on to
the next stage, as the operators of paper 000's chain do (§2). keyplane
decides where each key of each stage lives: routing tables that keep
correlated keys of consecutive stages together (000 §3), split hot keys
(001 §4.1.2) and the number of active instances (003). The stages only
declare *what* to compute, so that keyplane can move their state.

What reaches the sink is one row per (stage, key) updated in a micro-batch,
with the key's running result: :data:`OUTPUT_SCHEMA`. A split key's partial
states are merged before the sink sees them.

Everything here is a frozen, validated declaration with no Spark session
behind it, so that a mistake (two stages with one name, an aggregate that
is missing a method) fails where the pipeline is defined, in one line. The
expressions are checked against the schema when the job starts
(:func:`keyplane.spark.pipeline_frames.check_expressions`), before its query runs.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from keyplane.aggregates import REQUIRED_METHODS, KeyedAggregate, RunningCount

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

ValueFormat = Literal["json"]
"""How event values are encoded. JSON, parsed with the source's schema."""

OUTPUT_SCHEMA = "stage STRING, key STRING, result STRING, batch_id LONG"
"""The rows a sink receives: a key's running ``aggregate.result`` as JSON text,
one row per (stage, key) updated in batch ``batch_id``."""

STAGE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
"""A stage name: it names the stage in routing configurations, metrics, topics'
records and the Airflow forms, so it is kept to a plain identifier."""


class PipelineError(ValueError):
    """A pipeline that cannot run, said in one line that names the stage and the problem."""


@dataclass(frozen=True)
class KafkaSource:
    """The topics a pipeline reads, and how their values are encoded.

    ``schema`` is a Spark DDL string (``"user_id STRING, page STRUCT<category:
    STRING>"``) or a ``StructType``. An event whose value does not parse
    against it goes to the dead-letter topic with the reason; it stops nothing.
    """

    topics: tuple[str, ...]
    schema: str | StructType
    format: ValueFormat = "json"

    def __post_init__(self) -> None:
        topics = (self.topics,) if isinstance(self.topics, str) else tuple(self.topics)
        object.__setattr__(self, "topics", topics)
        if not topics or any(not isinstance(t, str) or not t.strip() for t in topics):
            raise PipelineError(f"source: topics must be non-empty names, got {self.topics!r}")
        if len(set(topics)) != len(topics):
            raise PipelineError(f"source: a topic is named twice in {list(topics)}")
        if isinstance(self.schema, str) and not self.schema.strip():
            raise PipelineError("source: the schema is empty")
        if self.format != "json":
            raise PipelineError(f"source: format {self.format!r} is not supported; use 'json'")


@dataclass(frozen=True)
class Stage:
    """One keyed stage: its name, its key, the value its aggregate receives, the aggregate.

    ``key`` and ``value`` are Spark SQL expressions over the parsed event
    (``"user_id"``, ``"page.category"``, ``"lower(country)"``); both are
    turned into strings. With no ``value``, the aggregate gets one empty
    string per event, which is all a count needs. An event whose key is null
    goes to the dead-letter topic, naming the stage.
    """

    name: str
    key: str
    aggregate: KeyedAggregate[Any] = field(default_factory=RunningCount)
    value: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not STAGE_NAME.fullmatch(self.name):
            raise PipelineError(
                f"stage {self.name!r}: a name is a letter then letters, digits, '_' or '-' "
                "(at most 64)"
            )
        if not isinstance(self.key, str) or not self.key.strip():
            raise PipelineError(f"stage {self.name!r}: the key expression is empty")
        if self.value is not None and (not isinstance(self.value, str) or not self.value.strip()):
            raise PipelineError(f"stage {self.name!r}: the value expression is empty")
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(self.aggregate, m, None))]
        if missing:
            raise PipelineError(
                f"stage {self.name!r}: the aggregate {type(self.aggregate).__name__} is not a "
                f"KeyedAggregate: missing {', '.join(missing)}"
            )
        try:
            text = self.aggregate.encode(self.aggregate.zero())
            self.aggregate.decode(text)
        except Exception as exc:
            raise PipelineError(
                f"stage {self.name!r}: the aggregate's zero() does not round-trip through "
                f"encode/decode: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise PipelineError(
                f"stage {self.name!r}: the aggregate's encode() must return str, "
                f"not {type(text).__name__}"
            )

    @property
    def aggregate_name(self) -> str:
        """The aggregate's class as ``module:qualname``, as a checkpoint records it."""
        kind = type(self.aggregate)
        return f"{kind.__module__}:{kind.__qualname__}"


@dataclass(frozen=True)
class KafkaSink:
    """Results to a Kafka topic: key ``stage/key``, value the :data:`OUTPUT_SCHEMA` row as JSON."""

    topic: str


@dataclass(frozen=True)
class ParquetSink:
    """Results appended to a parquet directory, one file set per micro-batch."""

    path: str


@dataclass(frozen=True)
class BatchSink:
    """Results handed to ``function(rows, batch_id)``, as ``foreachBatch`` would.

    ``rows`` is a DataFrame of :data:`OUTPUT_SCHEMA`. A batch can be handed
    over again after a crash, so the function should write idempotently per
    ``batch_id``.
    """

    function: Callable[[DataFrame, int], None]


Sink: TypeAlias = KafkaSink | ParquetSink | BatchSink


@dataclass(frozen=True)
class Pipeline:
    """A Kafka source, a chain of 1 to N keyed stages (upstream first), and a sink."""

    name: str
    source: KafkaSource
    stages: tuple[Stage, ...]
    sink: Sink

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        object.__setattr__(self, "stages", stages)
        if not isinstance(self.name, str) or not STAGE_NAME.fullmatch(self.name):
            raise PipelineError(f"pipeline {self.name!r}: the name must be a plain identifier")
        if not stages:
            raise PipelineError(f"pipeline {self.name!r}: it has no stage; give 1 or more")
        for stage in stages:
            if not isinstance(stage, Stage):
                raise PipelineError(
                    f"pipeline {self.name!r}: {stage!r} is not a Stage; build stages with "
                    "Stage(name, key, ...)"
                )
        seen: set[str] = set()
        for stage in stages:
            if stage.name in seen:
                raise PipelineError(
                    f"pipeline {self.name!r}: the stage name {stage.name!r} is used twice"
                )
            seen.add(stage.name)
        if not isinstance(self.sink, KafkaSink | ParquetSink | BatchSink):
            raise PipelineError(
                f"pipeline {self.name!r}: the sink must be a KafkaSink, ParquetSink or "
                f"BatchSink, not {type(self.sink).__name__}"
            )

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stages' names, upstream first: the order rollouts follow (000 §3.4)."""
        return tuple(stage.name for stage in self.stages)

    def stage(self, name: str) -> Stage:
        """The stage called ``name``; a :class:`PipelineError` naming the choices otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise PipelineError(
            f"pipeline {self.name!r} has no stage {name!r}; its stages are "
            f"{', '.join(self.stage_names)}"
        )

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the pipeline, to refuse a restart that changed it.

        Stages, keys, values and aggregates decide what the stored state
        means; topics and the sink do not, so they may change between runs.
        """
        return {
            "stages": [
                {
                    "name": s.name,
                    "key": s.key,
                    "value": s.value,
                    "aggregate": s.aggregate_name,
                }
                for s in self.stages
            ]
        }


def fingerprint_changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What changed between two :meth:`Pipeline.fingerprint` values, one phrase each.

    Empty when a checkpoint written with ``stored`` can run ``current``.
    """
    old = {s["name"]: s for s in stored.get("stages", [])}
    new = {s["name"]: s for s in current.get("stages", [])}
    changes = [f"stage {name!r} was removed" for name in old if name not in new]
    changes += [f"stage {name!r} was added" for name in new if name not in old]
    for name in old.keys() & new.keys():
        for part in ("key", "value", "aggregate"):
            if old[name].get(part) != new[name].get(part):
                changes.append(
                    f"stage {name!r}: {part} {old[name].get(part)!r} became {new[name].get(part)!r}"
                )
    if not changes and list(old) != list(new):
        changes.append(f"the stages' order {list(old)} became {list(new)}")
    return changes


def load_pipeline(spec: str) -> Pipeline:
    """The pipeline ``module:attribute`` names, as ``keyplane job start --pipeline`` takes it.

    The attribute is a :class:`Pipeline`, or a function that takes no
    argument and returns one. Whatever goes wrong (the import, the
    attribute, the user's own module raising) is one :class:`PipelineError`.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineError(f"pipeline {spec!r}: expected 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except PipelineError as exc:
        raise PipelineError(f"pipeline {spec!r}: {exc}") from exc
    except Exception as exc:
        raise PipelineError(
            f"pipeline {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PipelineError(f"pipeline {spec!r}: {module_name} has no {attr!r}") from None
    if callable(target) and not isinstance(target, Pipeline):
        try:
            target = target()
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(
                f"pipeline {spec!r}: {attr}() failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(target, Pipeline):
        raise PipelineError(
            f"pipeline {spec!r} is a {type(target).__name__}, not a keyplane Pipeline"
        )
    return target

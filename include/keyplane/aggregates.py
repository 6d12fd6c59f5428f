"""Keyed aggregates: the user's own stateful function in a routed stage.

A routed stage (:mod:`keyplane.spark.routed_counts`) keeps one state per
*routed key* and does three things with it that a plain keyed function never
has to: a hot key is split over several routed keys whose partial states are
combined into the key's answer (paper 001 §4.1.2), a moved key's state is
added to whatever its new routed key holds (paper 000 §3.4's state hand-off),
and a state travels through Kafka between two instances. So a stage's
function is not "a function of a key's rows" but an aggregate with a
*merge*, as Flink's ``AggregateFunction`` (createAccumulator / add / merge /
getResult) is for session windows, for the same reason:

* ``zero()`` — the state of a key that has seen nothing;
* ``add(state, values)`` — the state after this micro-batch's values for the
  key. One call per key per micro-batch with all its values, because a
  Python call per row is what makes PySpark stateful stages slow;
* ``merge(a, b)`` — one state that holds both partial states;
* ``result(state)`` — the answer for the key, JSON-safe;
* ``encode(state)`` / ``decode(text)`` — a state as text, to keep it in
  Spark's state store and to send it through the migration topic.

The contract, and why each law matters:

* ``merge`` is associative and commutative: the partials of a split key
  are combined in whatever order the reader finds them, and a moved state
  meets the new routed key's state in whatever order the batch delivers;
* ``zero()`` is merge's identity: a routed key whose state moved away
  reports ``zero()`` (a *tombstone*), and the merge must not change;
* ``add`` distributes over ``merge``: ``merge(add(zero, xs), add(zero, ys))``
  is ``add(zero, xs + ys)``. This is what makes splitting a key exact: the
  tuples of a hot key are divided among its routed keys and merged back;
* ``decode(encode(s))`` is ``s``; no function mutates its arguments.

:func:`keyplane.testing.check_aggregate_laws` checks all of them on examples;
run it under a property-testing library on your own aggregate.

What a stage passes to ``add``: each event's value, the stage's ``value``
expression turned into a string (:class:`keyplane.pipeline.Stage`).
"""

from __future__ import annotations

import importlib
import json
from collections import Counter
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol, TypeVar, runtime_checkable

S = TypeVar("S")

REQUIRED_METHODS = ("zero", "add", "merge", "result", "encode", "decode")


@runtime_checkable
class KeyedAggregate(Protocol[S]):
    """A keyed stateful function with a merge (see the module docstring for the contract)."""

    def zero(self) -> S:
        """The state of a key that has seen nothing; merge's identity."""
        ...

    def add(self, state: S, values: Sequence[str]) -> S:
        """The state after one micro-batch's ``values`` for the key (a new object)."""
        ...

    def merge(self, a: S, b: S) -> S:
        """One state holding both partial states; associative and commutative."""
        ...

    def result(self, state: S) -> Any:
        """The key's answer, JSON-safe (it goes to the results topic as it is)."""
        ...

    def encode(self, state: S) -> str:
        """The state as text, for Spark's state store and the migration topic."""
        ...

    def decode(self, text: str) -> S:
        """The state ``encode`` wrote."""
        ...


class RunningCount:
    """The reference application's function: how many events a key has seen (000 §4.1)."""

    def zero(self) -> int:
        return 0

    def add(self, state: int, values: Sequence[str]) -> int:
        return state + len(values)

    def merge(self, a: int, b: int) -> int:
        return a + b

    def result(self, state: int) -> int:
        return state

    def encode(self, state: int) -> str:
        return str(state)

    def decode(self, text: str) -> int:
        return int(text)


class ValueCounts:
    """How often a key met each value of the other field: a key's row of the pair matrix.

    For stage A of the geo-tags workload, how often each hashtag was used
    in a region. Its state is a multiset, so it shows that a state need not
    be a number, and unlike a set or a maximum its merge is not idempotent:
    a state counted twice or lost changes the answer.
    """

    def zero(self) -> Counter[str]:
        return Counter()

    def add(self, state: Counter[str], values: Sequence[str]) -> Counter[str]:
        out = Counter(state)
        out.update(values)
        return out

    def merge(self, a: Counter[str], b: Counter[str]) -> Counter[str]:
        return a + b

    def result(self, state: Counter[str]) -> dict[str, int]:
        return dict(sorted(state.items()))

    def encode(self, state: Counter[str]) -> str:
        return json.dumps(dict(sorted(state.items())), separators=(",", ":"))

    def decode(self, text: str) -> Counter[str]:
        return Counter({str(k): int(v) for k, v in json.loads(text).items()})


class Sum:
    """The sum of a key's values, each a decimal number written as text.

    Exact in decimal arithmetic, so that partials of a split key add up to
    what one state would hold whatever order they merge in (floats would
    not: their addition is not associative). The result is an ``int`` when
    the sum is whole, else a ``float``.
    """

    def zero(self) -> Decimal:
        return Decimal(0)

    def add(self, state: Decimal, values: Sequence[str]) -> Decimal:
        total = state
        for value in values:
            try:
                total += Decimal(value)
            except InvalidOperation:
                raise ValueError(f"Sum: {value!r} is not a number") from None
        return total

    def merge(self, a: Decimal, b: Decimal) -> Decimal:
        return a + b

    def result(self, state: Decimal) -> int | float:
        return int(state) if state == state.to_integral_value() else float(state)

    def encode(self, state: Decimal) -> str:
        return str(state)

    def decode(self, text: str) -> Decimal:
        return Decimal(text)


class DistinctCount:
    """How many distinct values a key has seen, exactly.

    The state is the set of values: an exact distinct count must know them
    to merge two partials that share some (a sketch would merge smaller,
    but not exactly).
    """

    def zero(self) -> frozenset[str]:
        return frozenset()

    def add(self, state: frozenset[str], values: Sequence[str]) -> frozenset[str]:
        return state | frozenset(values)

    def merge(self, a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
        return a | b

    def result(self, state: frozenset[str]) -> int:
        return len(state)

    def encode(self, state: frozenset[str]) -> str:
        return json.dumps(sorted(state), separators=(",", ":"))

    def decode(self, text: str) -> frozenset[str]:
        return frozenset(str(v) for v in json.loads(text))


class TopK(ValueCounts):
    """A key's ``k`` most frequent values with their counts, heaviest first (ties by value).

    It keeps every value's count, as :class:`ValueCounts` does: a partial
    that kept only its own top ``k`` could drop a value that is heavy
    overall, so merged partials would not give the exact answer.
    """

    def __init__(self, k: int = 3) -> None:
        if k < 1:
            raise ValueError(f"TopK: k must be 1 or more, not {k}")
        self.k = k

    def result(self, state: Counter[str]) -> list[list[Any]]:  # type: ignore[override]
        ranked = sorted(state.items(), key=lambda item: (-item[1], item[0]))
        return [[value, count] for value, count in ranked[: self.k]]


class AggregateSpecError(ValueError):
    """A ``module:attr`` that does not name a usable keyed aggregate (one line, for a CLI)."""


DEFAULT_AGGREGATE_SPEC = f"{__name__}:RunningCount"
"""The ``module:attr`` of the aggregate a stage runs when none is named."""


def canonical_spec(spec: str | None) -> str | None:
    """``spec``, with the default aggregate written as None.

    The running count may be named or left out; wherever aggregates are
    compared (a checkpoint's, a running job's), both spellings are one aggregate.
    """
    return None if spec == DEFAULT_AGGREGATE_SPEC else spec


def _cause(error: Exception) -> str:
    """``error`` in one line: the first line of its message, after its type unless it is an
    ImportError, whose message ("No module named 'x'") says enough on its own."""
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if isinstance(error, ImportError) and message:
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def load_aggregate(spec: str) -> KeyedAggregate[Any]:
    """The aggregate ``module:attr`` names: an instance, or a class built with no arguments.

    Checked at the boundary (job start), so that a typo fails there with one
    line rather than inside a Spark task: the import, the attribute, the six
    methods, and that ``zero()`` survives ``encode``/``decode`` as text. The
    user's module runs here, so whatever it raises while it is imported or
    its class is built (an error of its own, a syntax error) is an
    :class:`AggregateSpecError` too, not a traceback.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AggregateSpecError(f"aggregate {spec!r}: expected 'module:attr'")
    if module_name.startswith("."):
        raise AggregateSpecError(
            f"aggregate {spec!r}: {module_name!r} is a relative module name; name it in full"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AggregateSpecError(
            f"aggregate {spec!r}: cannot import {module_name!r}: {_cause(exc)}"
        ) from exc
    try:
        target = getattr(module, attr)
    except AttributeError:
        raise AggregateSpecError(f"aggregate {spec!r}: {module_name} has no {attr!r}") from None
    if isinstance(target, type):
        try:
            target = target()
        except Exception as exc:
            raise AggregateSpecError(
                f"aggregate {spec!r}: {attr}() failed (the class must build with no "
                f"arguments): {_cause(exc)}"
            ) from exc
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(target, m, None))]
    if missing:
        raise AggregateSpecError(
            f"aggregate {spec!r} is not a KeyedAggregate: missing {', '.join(missing)}"
        )
    try:
        text = target.encode(target.zero())
        target.decode(text)
    except Exception as exc:
        raise AggregateSpecError(f"aggregate {spec!r}: zero() does not round-trip: {exc}") from exc
    if not isinstance(text, str):
        raise AggregateSpecError(
            f"aggregate {spec!r}: encode() must return str, not {type(text).__name__}"
        )
    return target


def merge_encoded(aggregate: KeyedAggregate[Any], texts: Sequence[str]) -> Any:
    """The result of merging encoded partial states (a split key's answer, 001 §4.1.2)."""
    state = aggregate.zero()
    for text in texts:
        state = aggregate.merge(state, aggregate.decode(text))
    return aggregate.result(state)

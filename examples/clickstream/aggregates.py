"""Keyed aggregates of the clickstream example, each a plain class with the six methods.

They are written as a user would write their own: no keyplane base class is
needed, only the contract of :class:`keyplane.KeyedAggregate` (``merge`` is
associative and commutative with ``zero()`` as identity, and ``add``
distributes over it), which is what lets keyplane split a hot key and move
a state without changing the answer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence


class Sum:
    """The sum of integer values (milliseconds of dwell time)."""

    def zero(self) -> int:
        return 0

    def add(self, state: int, values: Sequence[str]) -> int:
        return state + sum(int(v) for v in values)

    def merge(self, a: int, b: int) -> int:
        return a + b

    def result(self, state: int) -> int:
        return state

    def encode(self, state: int) -> str:
        return str(state)

    def decode(self, text: str) -> int:
        return int(text)


class DistinctCount:
    """How many distinct values a key has met (page categories of a user)."""

    def zero(self) -> frozenset[str]:
        return frozenset()

    def add(self, state: frozenset[str], values: Sequence[str]) -> frozenset[str]:
        return state | frozenset(values)

    def merge(self, a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
        return a | b

    def result(self, state: frozenset[str]) -> int:
        return len(state)

    def encode(self, state: frozenset[str]) -> str:
        return json.dumps(sorted(state))

    def decode(self, text: str) -> frozenset[str]:
        return frozenset(json.loads(text))


class TopK:
    """The ``k`` most frequent values of a key (the busiest users of a category).

    The state keeps every value's count, not only the top k: a top-k of
    partial top-ks is not the top-k of the whole, so a split key's partials
    could not be merged exactly otherwise. Ties are broken by the value.
    """

    def __init__(self, k: int = 3) -> None:
        self.k = k

    def zero(self) -> Counter[str]:
        return Counter()

    def add(self, state: Counter[str], values: Sequence[str]) -> Counter[str]:
        return state + Counter(values)

    def merge(self, a: Counter[str], b: Counter[str]) -> Counter[str]:
        return a + b

    def result(self, state: Counter[str]) -> list[list[str | int]]:
        ranked = sorted(state.items(), key=lambda item: (-item[1], item[0]))
        return [[value, count] for value, count in ranked[: self.k]]

    def encode(self, state: Counter[str]) -> str:
        return json.dumps(dict(sorted(state.items())))

    def decode(self, text: str) -> Counter[str]:
        return Counter(json.loads(text))

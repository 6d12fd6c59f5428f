"""A running count whose work grows with its tuples, for the hot-key benchmark.

Paper 001 models an operator as a fixed cost per tuple (§3, Observation 2):
that is what makes the owner of a hot key the straggler. The reference
application's count costs almost nothing per tuple once its stages run in
the JVM and the source combines a partition's events per pair, so its hot
key is no straggler. ``CostlyCount`` stands for a keyed function that does
real work on each event (parsing a payload, scoring it): it counts like
:class:`~keyplane.aggregates.RunningCount` and, for every value, runs
``KEYPLANE_BENCH_TUPLE_WORK`` rounds of PBKDF2-SHA256, a fixed amount of CPU
in C. The job loads it by its ``module:attr`` name like any user aggregate,
so it runs in the Python stages.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence

from keyplane.aggregates import RunningCount

WORK_ENV = "KEYPLANE_BENCH_TUPLE_WORK"
SPEC = "_costly_aggregate:CostlyCount"


def work(value: str, rounds: int) -> bytes:
    """The fixed work one tuple costs: ``rounds`` rounds of PBKDF2-SHA256 over its value."""
    return hashlib.pbkdf2_hmac("sha256", value.encode(), b"keyplane", rounds)


def micros_per_tuple(rounds: int, samples: int = 2_000) -> float:
    """What one tuple's work costs on this machine, in µs (one core, no contention)."""
    started = time.perf_counter()
    for i in range(samples):
        work(str(i), rounds)
    return (time.perf_counter() - started) / samples * 1e6


class CostlyCount(RunningCount):
    """A running count that spends a fixed amount of CPU on every tuple it adds."""

    def __init__(self) -> None:
        self.rounds = int(os.environ.get(WORK_ENV, "1000"))

    def add(self, state: int, values: Sequence[str]) -> int:
        for value in values:
            work(value, self.rounds)
        return state + len(values)

"""The one interface every routing policy implements.

A policy maps a chunk of tuple keys to worker (instance) indices. Keys are
integer ids (string keys are mapped to ids at the edge). Policies may keep
state between chunks (sent counters, sketches), so chunks must be fed in
stream order. ``times`` gives each tuple's arrival time in seconds, which
time-aware policies (FISH's inferred waiting time, 001 §4.2.3) need; others
ignore it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

KeyArray = npt.NDArray[np.int64]
TimeArray = npt.NDArray[np.float64]
WorkerArray = npt.NDArray[np.int64]


@runtime_checkable
class Partitioner(Protocol):
    """Routes tuples, chunk by chunk, to one of ``n_workers`` instances."""

    name: str
    n_workers: int

    def route(self, keys: KeyArray, times: TimeArray) -> WorkerArray:
        """Return the worker index of each tuple, in order."""
        ...

"""Consistent-hash ring with virtual nodes (paper 001 §5).

Why: FISH gives each hot key a set of candidate workers and each cold key one
worker. With ``hash mod n`` almost every key changes worker when a worker
joins or leaves, so almost all keyed state would have to move. On a ring,
a key belongs to the first worker clockwise from its position, and a joining
or leaving worker only takes over or hands back the arcs next to its own
virtual nodes (001 §5, Figure 8). Virtual nodes (001 §5, "small-scale worker
deployment") even out the arc lengths when there are few workers.

Hashing, fixed so every process agrees:

* a key (an int64 id) sits at bucket ``SHA-1(id as 8 bytes little-endian,
  two's complement)``, first 4 bytes read big-endian, in ``[0, 2^32)``: the
  2^32 bucket space of 001 §5;
* virtual node ``r`` of worker ``w`` sits at ``SHA-1(b"worker-{w}#{r}")``
  read the same way. Ties between positions are broken by worker id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

DEFAULT_VIRTUAL_NODES = 160
"""Virtual nodes per worker. 160 is libketama's choice (the consistent-hashing
scheme memcached clients use): with ``v`` nodes a worker's share of the ring
has a relative spread of about ``1/sqrt(v)``, so 160 keeps arcs within about
±8% of fair at a ring of only 160·n positions."""

BUCKETS = 2**32
"""Size of the hash space (001 §5 uses a 32-bit hash)."""

_CACHE_LIMIT = 1 << 20


def key_bucket(key: int) -> int:
    """Ring position of one int64 key."""
    digest = hashlib.sha1(int(key).to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest[:4], "big")


def node_bucket(worker: int, replica: int) -> int:
    """Ring position of virtual node ``replica`` of ``worker``."""
    digest = hashlib.sha1(f"worker-{worker}#{replica}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


class ConsistentHashRing:
    """A ring of workers, each placed at ``virtual_nodes`` positions.

    ``candidates(key, d)`` walks clockwise from the key and returns the first
    ``d`` distinct workers met. The walk is a prefix walk, so a key's
    candidates for ``d`` are the first ``d`` of its candidates for ``d + 1``:
    growing a hot key's ``d`` only adds workers.
    """

    def __init__(
        self, workers: Iterable[int] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    ) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be positive, got {virtual_nodes}")
        self._virtual_nodes = virtual_nodes
        self._workers: set[int] = set()
        self._bucket_cache: dict[int, int] = {}
        self._positions = np.empty(0, dtype=np.int64)
        self._owners = np.empty(0, dtype=np.int64)
        self._owner_list: list[int] = []
        self._candidate_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        for worker in workers:
            self._check_new(worker)
            self._workers.add(int(worker))
        self._rebuild()

    @classmethod
    def of_size(
        cls, n_workers: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    ) -> ConsistentHashRing:
        """Ring over workers ``0 … n_workers - 1``."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        return cls(range(n_workers), virtual_nodes)

    @property
    def virtual_nodes(self) -> int:
        """Virtual nodes per worker."""
        return self._virtual_nodes

    @property
    def workers(self) -> tuple[int, ...]:
        """The workers on the ring, sorted."""
        return tuple(sorted(self._workers))

    def __len__(self) -> int:
        return len(self._workers)

    def _check_new(self, worker: int) -> None:
        if worker in self._workers:
            raise ValueError(f"worker {worker} is already on the ring")

    def _rebuild(self) -> None:
        nodes = [
            (node_bucket(w, r), w)
            for w in sorted(self._workers)
            for r in range(self._virtual_nodes)
        ]
        nodes.sort()
        self._positions = np.array([p for p, _ in nodes], dtype=np.int64)
        self._owner_list = [w for _, w in nodes]
        self._owners = np.array(self._owner_list, dtype=np.int64)
        self._candidate_cache = {}

    def add_worker(self, worker: int) -> None:
        """Place a new worker; it takes over the arcs just before its virtual nodes."""
        self._check_new(worker)
        self._workers.add(int(worker))
        self._rebuild()

    def remove_worker(self, worker: int) -> None:
        """Remove a worker; its arcs go to the next worker clockwise."""
        if worker not in self._workers:
            raise ValueError(f"worker {worker} is not on the ring")
        self._workers.remove(worker)
        self._rebuild()

    def _require_workers(self) -> None:
        if not self._workers:
            raise ValueError("the ring has no workers")

    def bucket(self, key: int) -> int:
        """Ring position of one key (cached)."""
        key = int(key)
        bucket = self._bucket_cache.get(key)
        if bucket is None:
            if len(self._bucket_cache) > _CACHE_LIMIT:
                self._bucket_cache.clear()
            bucket = key_bucket(key)
            self._bucket_cache[key] = bucket
        return bucket

    def buckets(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Ring position of each key (SHA-1 computed once per distinct key, then cached)."""
        arr = np.asarray(keys, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        uniq, inverse = np.unique(arr, return_inverse=True)
        cache = self._bucket_cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        values = []
        for key in uniq.tolist():
            bucket = cache.get(key)
            if bucket is None:
                bucket = key_bucket(key)
                cache[key] = bucket
            values.append(bucket)
        return np.array(values, dtype=np.int64)[inverse]

    def owners(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """First worker clockwise of each key: a cold key's single worker."""
        self._require_workers()
        index = np.searchsorted(self._positions, self.buckets(keys), side="left")
        index[index == self._positions.size] = 0
        return self._owners[index]

    def owner(self, key: int) -> int:
        """First worker clockwise of one key."""
        return self.candidates(key, 1)[0]

    def candidates(self, key: int, d: int) -> tuple[int, ...]:
        """The first ``d`` distinct workers clockwise from the key (001 §5)."""
        self._require_workers()
        if not 1 <= d <= len(self._workers):
            raise ValueError(f"d must be in [1, {len(self._workers)}], got {d}")
        cached = self._candidate_cache.get((key, d))
        if cached is not None:
            return cached
        start = int(np.searchsorted(self._positions, self.bucket(key), side="left"))
        owners, size = self._owner_list, len(self._owner_list)
        found: list[int] = []
        for step in range(size):
            worker = owners[(start + step) % size]
            if worker not in found:
                found.append(worker)
                if len(found) == d:
                    break
        result = tuple(found)
        if len(self._candidate_cache) > _CACHE_LIMIT:
            self._candidate_cache.clear()
        self._candidate_cache[(key, d)] = result
        return result

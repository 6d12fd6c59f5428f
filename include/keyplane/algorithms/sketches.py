"""Bounded-memory frequency sketches: SpaceSaving and FISH's epoch top-K.

Paper 000 §3.2 collects the frequency of key *pairs* (input key, output key)
with SpaceSaving (Metwally et al.) so that statistics use bounded memory
whatever the number of distinct pairs. Paper 001 §4.1 counts recent hot keys
with a bounded top-K whose counts decay once per epoch. Both are the same
counter table: a new item evicts the smallest counter and inherits its count
plus its own weight (001 calls this ReplaceMin). :class:`SpaceSaving` is that
table with error tracking and merging; :class:`EpochTopK` adds the per-epoch
decay.

Guarantees of :class:`SpaceSaving` with ``m`` counters after a stream (or a
merge of streams) of total weight ``N``, for every item ``x`` with true
weight ``f(x)``:

* ``estimate(x) - error(x) <= f(x) <= estimate(x)``;
* ``estimate(x) - f(x) <= error(x) <= N / m``;
* every item with ``f(x) > N / m`` is monitored.

Items are hashable: int ids, tuples of int ids (a key pair is ``(a, b)``),
or any other hashable (serialisation supports ints and int tuples).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Weight = int | float


@dataclass(frozen=True)
class FrequentItem:
    """One monitored item: its estimated weight and the maximal overestimate."""

    item: Hashable
    count: Weight
    error: Weight

    @property
    def guaranteed(self) -> Weight:
        """Weight the item certainly has (``count - error``)."""
        return self.count - self.error


def _check_weights(weights: npt.ArrayLike, n_items: int) -> npt.NDArray[Any]:
    w = np.asarray(weights)
    if w.shape != (n_items,):
        raise ValueError(f"weights must have shape ({n_items},), got {w.shape}")
    if w.dtype.kind not in "iuf":
        raise ValueError(f"weights must be numeric, got dtype {w.dtype}")
    if w.size and (not np.all(np.isfinite(w)) or np.any(w < 0)):
        raise ValueError("weights must be finite and non-negative")
    return w


def _aggregate_rows(
    rows: npt.NDArray[np.integer[Any]], weights: npt.NDArray[Any] | None
) -> tuple[list[Hashable], list[Weight]]:
    """Distinct rows of a 2-D integer array (as tuples) with their summed weights."""
    n, width = rows.shape
    if n == 0:
        return [], []
    if width == 2 and rows.dtype.kind == "i":
        lo, hi = rows.min(), rows.max()
        if lo >= 0 and hi < 2**31:
            # Both ids fit in 31 bits: pack a pair into one int64 so a plain
            # 1-D unique (much faster than a lexsort) groups it.
            packed = (rows[:, 0].astype(np.int64) << 32) | rows[:, 1].astype(np.int64)
            if weights is None:
                uniq, counts = np.unique(packed, return_counts=True)
                total: npt.NDArray[Any] = counts
            else:
                uniq, inverse = np.unique(packed, return_inverse=True)
                total = np.bincount(inverse, weights=weights, minlength=uniq.size)
            pairs = zip((uniq >> 32).tolist(), (uniq & 0xFFFFFFFF).tolist(), strict=True)
            return list(pairs), total.tolist()
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    changed = np.any(ordered[1:] != ordered[:-1], axis=1)
    starts = np.flatnonzero(np.concatenate(([True], changed)))
    if weights is None:
        total = np.diff(np.append(starts, n))
    else:
        total = np.add.reduceat(weights[order], starts)
    return [tuple(r) for r in ordered[starts].tolist()], total.tolist()


def aggregate_items(
    items: npt.ArrayLike | Iterable[Hashable], weights: npt.ArrayLike | None = None
) -> tuple[list[Hashable], list[Weight]]:
    """Group a chunk of items into (distinct items, summed weights).

    A 1-D integer array gives int items, a 2-D ``(n, k)`` integer array gives
    k-tuples (``k = 2`` for key pairs); numpy does the grouping. Any other
    sequence of hashables is grouped with a :class:`collections.Counter`.
    Distinct items come in a deterministic order (sorted for arrays,
    first-seen otherwise).
    """
    arr: npt.NDArray[Any] | None = None
    if isinstance(items, np.ndarray):
        arr = items
    elif isinstance(items, Sequence) and items and not isinstance(items[0], str):
        try:
            arr = np.asarray(items)
        except ValueError:  # ragged, e.g. tuples of different lengths
            arr = None
    if arr is not None and arr.dtype.kind in "iu" and arr.ndim in (1, 2):
        w = None if weights is None else _check_weights(weights, arr.shape[0])
        if arr.ndim == 2:
            return _aggregate_rows(arr, w)
        if w is None:
            uniq, counts = np.unique(arr, return_counts=True)
            return uniq.tolist(), counts.tolist()
        uniq, inverse = np.unique(arr, return_inverse=True)
        return uniq.tolist(), np.bincount(inverse, weights=w, minlength=uniq.size).tolist()
    seq: list[Hashable] = list(items)  # type: ignore[arg-type]
    if weights is None:
        counter: Counter[Hashable] = Counter(seq)
        return list(counter.keys()), list(counter.values())
    w = _check_weights(weights, len(seq))
    summed: dict[Hashable, Weight] = {}
    for item, weight in zip(seq, w.tolist(), strict=True):
        summed[item] = summed.get(item, 0) + weight
    return list(summed.keys()), list(summed.values())


class SpaceSaving:
    """SpaceSaving top-frequency summary with ``capacity`` counters (000 §3.2).

    Why this algorithm: paper 000 §3.2 needs the most frequent key pairs of an
    unbounded stream in a few MB per instance; SpaceSaving gives deterministic
    error bounds (see the module docstring) with ``capacity`` counters.

    Chunked updates: :meth:`update_many` first sums the chunk per distinct
    item with numpy and then applies the (weighted) SpaceSaving rule once per
    distinct item: a monitored item's counter grows by its weight; a new item
    takes a free counter, or evicts the minimum counter ``μ`` and gets count
    ``μ + w`` with error ``μ``. Summing a chunk first is the same as feeding
    the chunk reordered so that equal items are adjacent, and weighted
    SpaceSaving keeps its guarantees for every order and every positive
    weight (the sum of counters always equals the stream weight, so
    ``μ <= N / m``). So the guarantees hold exactly, not approximately.
    Within a chunk, monitored items are updated first and new items follow by
    decreasing weight, so a heavy newcomer is never evicted by a light one of
    the same chunk.

    The minimum is found with a heap holding one entry per counter whose key
    is a lower bound of the counter (counters only grow); a stale entry met at
    the top is re-keyed. A monitored update is then O(1) and an eviction
    O(log m) amortised, and memory stays O(m).

    :meth:`scale` is O(1): counters are stored in units of a running scale
    factor (true value = stored value × factor), which keeps their order, so
    the heap stays valid. Stored values are renormalised when the factor gets
    tiny.
    """

    _RENORMALISE_BELOW = 1e-150

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._capacity = capacity
        self._total: Weight = 0
        self._unit = 1.0
        self._slot_of: dict[Hashable, int] = {}
        self._items: list[Hashable] = []
        self._counts: list[Weight] = []
        self._errors: list[Weight] = []
        self._heap: list[tuple[Weight, int]] = []

    @property
    def capacity(self) -> int:
        """Number of counters ``m``."""
        return self._capacity

    @property
    def total(self) -> Weight:
        """Total weight ``N`` of the summarised stream."""
        return self._total

    @property
    def is_full(self) -> bool:
        """Whether every counter is in use (only then are items ever evicted)."""
        return len(self._items) >= self._capacity

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._slot_of

    def _true(self, stored: Weight) -> Weight:
        return stored if self._unit == 1.0 else stored * self._unit

    def _true_list(self, stored: list[Weight]) -> list[Weight]:
        unit = self._unit
        return list(stored) if unit == 1.0 else [v * unit for v in stored]

    def min_count(self) -> Weight:
        """Upper bound on the true weight of any unmonitored item.

        It is the smallest counter when the summary is full and 0 otherwise
        (an unfull summary has never evicted anything).
        """
        if not self.is_full:
            return 0
        return self._true(self._peek_min()[0])

    def _peek_min(self) -> tuple[Weight, int]:
        heap, counts = self._heap, self._counts
        while True:
            key, slot = heap[0]
            current = counts[slot]
            if current == key:
                return key, slot
            heapq.heapreplace(heap, (current, slot))

    def update(self, item: Hashable, weight: Weight = 1) -> None:
        """Add one item with a non-negative weight."""
        if not weight >= 0 or not math.isfinite(weight):
            raise ValueError(f"weights must be finite and non-negative, got {weight!r}")
        self._apply([item], [weight])

    def update_many(
        self,
        items: npt.ArrayLike | Iterable[Hashable],
        weights: npt.ArrayLike | None = None,
    ) -> None:
        """Add a chunk of items (see the class docstring for how chunks keep the bounds).

        ``items`` is a 1-D int array (int ids), a 2-D ``(n, 2)`` int array (key
        pairs, stored as ``(a, b)`` tuples) or any sequence of hashables.
        ``weights`` defaults to one per item.
        """
        distinct, summed = aggregate_items(items, weights)
        self._apply(distinct, summed)

    def _apply(self, distinct: list[Hashable], weights: list[Weight]) -> None:
        """Apply validated (finite, non-negative) weights, one per distinct item."""
        self._total += sum(weights)
        unit = self._unit
        stored_weights = weights if unit == 1.0 else [w / unit for w in weights]
        slot_of, counts = self._slot_of, self._counts
        lookup = slot_of.get
        newcomers: list[tuple[Hashable, Weight]] = []
        for item, stored in zip(distinct, stored_weights, strict=True):
            slot = lookup(item)
            if slot is not None:
                counts[slot] += stored
            elif stored > 0:
                newcomers.append((item, stored))
        if not newcomers:
            return
        newcomers.sort(key=lambda pair: pair[1], reverse=True)
        items, errors, heap, capacity = self._items, self._errors, self._heap, self._capacity
        for item, stored in newcomers:
            if len(items) < capacity:
                slot = len(items)
                items.append(item)
                counts.append(stored)
                errors.append(0)
                slot_of[item] = slot
                heapq.heappush(heap, (stored, slot))
                continue
            floor, slot = self._peek_min()
            del slot_of[items[slot]]
            items[slot] = item
            slot_of[item] = slot
            counts[slot] = floor + stored
            errors[slot] = floor
            heapq.heapreplace(heap, (floor + stored, slot))

    def estimate(self, item: Hashable) -> Weight:
        """Upper bound on the item's weight (its counter, or :meth:`min_count`)."""
        slot = self._slot_of.get(item)
        return self.min_count() if slot is None else self._true(self._counts[slot])

    def error(self, item: Hashable) -> Weight:
        """Maximal overestimate of :meth:`estimate` (``estimate - error`` is a lower bound)."""
        slot = self._slot_of.get(item)
        return self.min_count() if slot is None else self._true(self._errors[slot])

    def top(self, k: int | None = None) -> list[FrequentItem]:
        """The ``k`` monitored items with the largest counts (all if ``k`` is None)."""
        n = len(self._items) if k is None else min(k, len(self._items))
        slots = heapq.nlargest(n, range(len(self._items)), key=self._counts.__getitem__)
        return [
            FrequentItem(self._items[s], self._true(self._counts[s]), self._true(self._errors[s]))
            for s in slots
        ]

    def counts(self) -> dict[Hashable, Weight]:
        """Every monitored item with its estimated weight."""
        return dict(zip(self._items, self._true_list(self._counts), strict=True))

    def items_at_least(self, min_count: float) -> dict[Hashable, Weight]:
        """Monitored items whose estimated weight is at least ``min_count`` (vectorised)."""
        if not self._items:
            return {}
        true = np.asarray(self._counts, dtype=np.float64) * self._unit
        slots = np.flatnonzero(true >= min_count).tolist()
        return {self._items[s]: self._true(self._counts[s]) for s in slots}

    def scale(self, factor: float) -> None:
        """Multiply every counter, error and the total by ``factor`` in ``[0, 1]``.

        SpaceSaving only compares counters, so scaling them all is the same
        as having scaled every earlier weight: the result is exactly the
        summary of the down-weighted stream, with its guarantees. FISH uses
        this for its once-per-epoch decay (001 §4.1.1). A factor of 0
        forgets everything.
        """
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"scale factor must be in [0, 1], got {factor}")
        if factor == 0.0:
            self._total = 0
            self._unit = 1.0
            self._slot_of.clear()
            self._items.clear()
            self._counts.clear()
            self._errors.clear()
            self._heap.clear()
            return
        if factor == 1.0:
            return
        self._total *= factor
        self._unit *= factor
        if self._unit < self._RENORMALISE_BELOW:
            self._counts = self._true_list(self._counts)
            self._errors = self._true_list(self._errors)
            self._unit = 1.0
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(c, s) for s, c in enumerate(self._counts)]
        heapq.heapify(self._heap)

    def merge(self, other: SpaceSaving) -> SpaceSaving:
        """Summary of the concatenation of both streams (Agarwal et al. mergeable summaries).

        Each item's count (and error) in the union is its counter in each
        summary, or that summary's :meth:`min_count` where it is not
        monitored; the ``m`` largest are kept. Why the bounds survive: every
        unmonitored item of a summary weighs at most its ``min_count``, so
        counts stay upper bounds and ``count - error`` lower bounds; the kept
        counters sum to at most ``N_a + N_b`` (an item new to one side only
        displaces a counter at least as large as that side's minimum), so the
        new minimum is at most ``N / m``; and errors add up to at most
        ``N_a / m + N_b / m``. Used to combine the per-partition sketches that
        Spark tasks build. Returns a new summary; neither input changes.
        """
        if other.capacity != self._capacity:
            raise ValueError(
                f"cannot merge SpaceSaving of capacity {self._capacity} with {other.capacity}"
            )
        floor_a, floor_b = self.min_count(), other.min_count()
        counts_b, errors_b = other._true_list(other._counts), other._true_list(other._errors)
        merged: dict[Hashable, tuple[Weight, Weight]] = {}
        other_slot = other._slot_of
        for item, count, err in zip(
            self._items, self._true_list(self._counts), self._true_list(self._errors), strict=True
        ):
            slot = other_slot.get(item)
            if slot is None:
                merged[item] = (count + floor_b, err + floor_b)
            else:
                merged[item] = (count + counts_b[slot], err + errors_b[slot])
        for item, count, err in zip(other._items, counts_b, errors_b, strict=True):
            if item not in self._slot_of:
                merged[item] = (count + floor_a, err + floor_a)
        kept = heapq.nlargest(self._capacity, merged.items(), key=lambda kv: kv[1][0])
        result = SpaceSaving(self._capacity)
        result._load(
            [item for item, _ in kept],
            [count for _, (count, _) in kept],
            [err for _, (_, err) in kept],
            self._total + other._total,
        )
        return result

    def _load(
        self, items: list[Hashable], counts: list[Weight], errors: list[Weight], total: Weight
    ) -> None:
        if len(items) > self._capacity:
            raise ValueError(f"{len(items)} items exceed capacity {self._capacity}")
        if not (len(items) == len(counts) == len(errors)):
            raise ValueError("items, counts and errors must have the same length")
        self._items = list(items)
        self._counts = list(counts)
        self._errors = list(errors)
        self._unit = 1.0
        self._slot_of = {item: slot for slot, item in enumerate(self._items)}
        if len(self._slot_of) != len(self._items):
            raise ValueError("items must be distinct")
        self._total = total
        self._rebuild_heap()

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON- and Arrow-friendly columns: equal-length lists plus two scalars.

        Int items go to column ``key``; k-tuples of ints to ``key_0`` …
        ``key_{k-1}``; ``count`` and ``error`` follow. ``pyarrow.table`` of the
        list-valued entries is a valid table.
        """
        out: dict[str, Any] = {"capacity": self._capacity, "total": self._total}
        items = self._items
        if items and isinstance(items[0], tuple):
            width = len(items[0])
            if any(not isinstance(i, tuple) or len(i) != width for i in items):
                raise ValueError("tuple items must all have the same length to serialise")
            for j in range(width):
                out[f"key_{j}"] = [_plain(i[j]) for i in items]  # type: ignore[index]
        else:
            out["key"] = [_plain(i) for i in items]
        out["count"] = [_plain(c) for c in self._true_list(self._counts)]
        out["error"] = [_plain(e) for e in self._true_list(self._errors)]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpaceSaving:
        """Rebuild a summary written by :meth:`to_dict` (columns may be lists or arrays)."""
        try:
            sketch = cls(int(data["capacity"]))
            counts = _as_list(data["count"])
            errors = _as_list(data["error"])
            total = data["total"]
        except KeyError as missing:
            raise ValueError(f"SpaceSaving dict lacks field {missing}") from None
        if "key" in data:
            items: list[Hashable] = _as_list(data["key"])
        else:
            width = sum(1 for name in data if name.startswith("key_"))
            if width == 0:
                raise ValueError("SpaceSaving dict has neither 'key' nor 'key_0' columns")
            columns = [_as_list(data[f"key_{j}"]) for j in range(width)]
            items = list(zip(*columns, strict=True))
        sketch._load(items, counts, errors, _plain(total))
        return sketch

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """The per-item columns of :meth:`to_dict` as numpy arrays."""
        return {
            name: np.asarray(values)
            for name, values in self.to_dict().items()
            if name not in ("capacity", "total")
        }


def _plain(value: Any) -> Any:
    """A numpy scalar as the equivalent Python number (for JSON and dict keys)."""
    return value.item() if isinstance(value, np.generic) else value


def _as_list(values: Any) -> list[Any]:
    if isinstance(values, np.ndarray):
        return list(values.tolist())
    return [_plain(v) for v in values]


class EpochTopK:
    """FISH's recent hot-key counter: bounded top-K with epoch decay (001 §4.1.1).

    Why: paper 001 wants the keys that are hot *now* (time-evolving streams),
    at low cost. Intra-epoch, a bounded table of ``capacity`` counters counts
    keys; an unseen key replaces the smallest counter and inherits its count
    plus one (ReplaceMin, so a newcomer is not evicted at once by the next
    newcomer). Inter-epoch, all counters (and the total) are multiplied by
    ``decay`` once at each epoch end instead of decaying on every tuple, which
    is what makes the scheme cheap (001 §4.1.1: three orders of magnitude
    fewer decay updates with epochs of about a thousand tuples).

    The counter table is a :class:`SpaceSaving` summary, so the decayed
    counts keep its error bounds on the decayed stream.
    """

    def __init__(self, capacity: int, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self._sketch = SpaceSaving(capacity)
        self._decay = decay
        self._epochs = 0

    @property
    def capacity(self) -> int:
        """Maximum number of keys held."""
        return self._sketch.capacity

    @property
    def decay(self) -> float:
        """Factor every count is multiplied by at each epoch end."""
        return self._decay

    @property
    def epochs(self) -> int:
        """Number of completed epochs."""
        return self._epochs

    @property
    def total(self) -> Weight:
        """Decayed weight of the whole stream (denominator of a key's share)."""
        return self._sketch.total

    def update_many(self, keys: npt.ArrayLike, weights: npt.ArrayLike | None = None) -> None:
        """Count a chunk of int keys in the current epoch."""
        self._sketch.update_many(np.asarray(keys, dtype=np.int64).reshape(-1), weights)

    def end_epoch(self, epochs: int = 1) -> None:
        """Close ``epochs`` epochs: multiply all counts by ``decay ** epochs``."""
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs}")
        self._sketch.scale(self._decay**epochs)
        self._epochs += epochs

    def frequencies(self) -> dict[int, float]:
        """Each held key's decayed count (an overestimate by at most total/capacity)."""
        return {int(k): float(c) for k, c in self._sketch.counts().items()}  # type: ignore[call-overload]

    def frequencies_at_least(self, min_share: float) -> dict[int, float]:
        """Held keys whose decayed count is at least ``min_share`` of :attr:`total`."""
        at_least = self._sketch.items_at_least(min_share * float(self._sketch.total))
        return {int(k): float(c) for k, c in at_least.items()}  # type: ignore[call-overload]

    def top(self, k: int | None = None) -> list[FrequentItem]:
        """The ``k`` keys with the largest decayed counts."""
        return self._sketch.top(k)

    def estimate(self, key: int) -> Weight:
        """Decayed count of a key (upper bound)."""
        return self._sketch.estimate(int(key))

    def merge(self, other: EpochTopK) -> EpochTopK:
        """Counter of both streams; both must use the same capacity and decay."""
        if not math.isclose(self._decay, other._decay):
            raise ValueError(f"cannot merge EpochTopK with decay {self._decay} and {other._decay}")
        result = EpochTopK(self.capacity, self._decay)
        result._sketch = self._sketch.merge(other._sketch)
        result._epochs = max(self._epochs, other._epochs)
        return result

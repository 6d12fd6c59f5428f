"""Synthetic keyed two-field event streams, deterministic by seed.

The simulator, the benchmarks and the ``keyplane generate`` command all draw
their input from here, so that a claim measured in one place ("locality-aware
routing beats hashing", "online reconfiguration beats offline", "hot-key
splitting keeps the load even after the hot set moves") can be replayed
bit-for-bit anywhere else from a small, validated spec.

Every stream is a sequence of events ``(a, b, pad)``: ``a`` is the key of the
first stateful operator (paper 000 §4.1: operator A groups by field 1),
``b`` the key of the second (operator B groups by field 2) and ``pad`` a
padding length in bytes that models the tuple size.

Determinism does not depend on how the stream is cut: events are produced in
fixed internal blocks, each block drawing from its own random generator
seeded by ``(seed, workload kind, block index)``; ``batches`` only re-cuts
those blocks. The same spec therefore yields the same events for any
``chunk_size``, and any range can be regenerated on its own with ``events``
(a producer restarting from an offset needs no replay).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Annotated, Any, Final, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

__all__ = [
    "MAX_KEYS",
    "MAX_PAD_BYTES",
    "MAX_REGIONS",
    "EventBatch",
    "FlashEvent",
    "GeoTagsWorkload",
    "PairsWorkload",
    "WorkloadSpec",
    "ZipfEvolvingWorkload",
    "parse_workload",
]

MAX_PAD_BYTES: Final = 20_000
"""Largest padding of paper 000 §4.2 ("We vary the padding between 0 and 20kB")."""

MAX_KEYS: Final = 10_000_000
"""Most keys of one field (``n_keys``, ``n_tags``). Zipf draws and relabellings hold
an 8-byte table entry per key, 80 MB at this bound; a spec past it would fail
with a memory error, or numpy's int64 overflow, only once events are drawn
(after a command has created its topic), so validation refuses it first. Ten
times the largest key count of the benchmarks (a million)."""

MAX_REGIONS: Final = 100_000
"""Most regions of a geo-tags stream: each holds ``favourites_per_region`` slots that
are rehashed for every drift epoch a block spans, so regions cost more than keys."""

_BLOCK: Final = 1 << 16
"""Events per internal block; the unit of seeding, so never change it lightly:
it would change every generated stream."""

_KIND_CODE: Final = {"pairs": 1, "zipf-evolving": 2, "geo-tags": 3}
"""Mixed into every seed so two kinds with the same ``seed`` are independent."""

_STREAM_EVENTS: Final = 0
_STREAM_MAPPING: Final = 1
_STREAM_FLASH: Final = 2
_STREAM_LAYOUT: Final = 3


PadFill = Literal["repeated", "random"]
"""What a padding is made of: one repeated character, or characters that do
not compress (so that a compressed shuffle or topic still moves its bytes)."""


@dataclass(frozen=True, eq=False)
class EventBatch:
    """A contiguous run of events, in stream order.

    ``start`` is the sequence number of the first event, so the events are
    ``start, start + 1, ...``. ``a`` is the field-1 key, ``b`` the field-2 key
    and ``pad`` the padding length in bytes (0 where the workload has none),
    made of ``pad_fill``.
    """

    start: int
    a: NDArray[np.int64]
    b: NDArray[np.int64]
    pad: NDArray[np.int32]
    pad_fill: PadFill = "repeated"

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"EventBatch.start must be >= 0, got {self.start}")
        if not (len(self.a) == len(self.b) == len(self.pad)):
            raise ValueError(
                "EventBatch arrays must have the same length, got "
                f"a={len(self.a)}, b={len(self.b)}, pad={len(self.pad)}"
            )

    def __len__(self) -> int:
        return len(self.a)

    @property
    def stop(self) -> int:
        """Sequence number one past the last event."""
        return self.start + len(self.a)

    @property
    def positions(self) -> NDArray[np.int64]:
        """Sequence numbers of the events, usable as logical arrival times."""
        return np.arange(self.start, self.stop, dtype=np.int64)


@dataclass(frozen=True)
class FlashEvent:
    """A hashtag that is suddenly very popular in a few regions for a while.

    Active for the events ``start <= position < stop``.
    """

    start: int
    stop: int
    tag: int
    regions: tuple[int, ...]


class _StreamSpec(BaseModel):
    """Shared fields and block machinery of every workload spec."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_events: int = Field(default=1_000_000, ge=0, description="Length of the stream.")
    seed: int = Field(default=0, ge=0, description="Seed; same spec and seed, same stream.")

    def _kind_code(self) -> int:
        kind: str = getattr(self, "kind")  # noqa: B009 - every concrete spec declares it
        return _KIND_CODE[kind]

    def _generate(
        self, start: int, size: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]:
        raise NotImplementedError

    def _block(self, index: int) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]:
        start = index * _BLOCK
        size = min(_BLOCK, self.n_events - start)
        rng = np.random.default_rng([self.seed, self._kind_code(), _STREAM_EVENTS, index])
        return self._generate(start, size, rng)

    def events(self, start: int, stop: int) -> EventBatch:
        """The events ``start <= position < stop``, identical to the same slice
        of the full stream."""
        if not 0 <= start <= stop <= self.n_events:
            raise ValueError(
                f"need 0 <= start <= stop <= n_events={self.n_events}, got [{start}, {stop})"
            )
        parts = [
            self._block(index)
            for index in range(start // _BLOCK, -(-stop // _BLOCK))
            if start < stop
        ]
        offset = start - (start // _BLOCK) * _BLOCK
        return _join(start, parts, offset, stop - start, self._pad_fill())

    def _pad_fill(self) -> PadFill:
        return "repeated"

    def batches(self, chunk_size: int = 100_000) -> Iterator[EventBatch]:
        """Yield the whole stream in order, in batches of ``chunk_size`` events
        (the last one may be shorter). The events do not depend on
        ``chunk_size``."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        pending: list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]] = []
        pending_len = 0
        emitted = 0
        for index in range(-(-self.n_events // _BLOCK)):
            a, b, pad = self._block(index)
            offset = 0
            while offset < len(a):
                take = min(chunk_size - pending_len, len(a) - offset)
                pending.append(
                    (
                        a[offset : offset + take],
                        b[offset : offset + take],
                        pad[offset : offset + take],
                    )
                )
                pending_len += take
                offset += take
                if pending_len == chunk_size:
                    yield _join(emitted, pending, 0, pending_len, self._pad_fill())
                    emitted += pending_len
                    pending, pending_len = [], 0
        if pending_len:
            yield _join(emitted, pending, 0, pending_len, self._pad_fill())


def _join(
    start: int,
    parts: list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]],
    offset: int,
    length: int,
    pad_fill: PadFill,
) -> EventBatch:
    """Concatenate block parts and keep ``length`` events from ``offset``."""
    if not parts:
        return EventBatch(
            start,
            np.empty(0, dtype=np.int64),
            np.empty(0, dtype=np.int64),
            np.empty(0, dtype=np.int32),
            pad_fill,
        )
    if len(parts) == 1:
        a, b, pad = parts[0]
    else:
        a = np.concatenate([p[0] for p in parts])
        b = np.concatenate([p[1] for p in parts])
        pad = np.concatenate([p[2] for p in parts])
    end = offset + length
    return EventBatch(start, a[offset:end], b[offset:end], pad[offset:end], pad_fill)


@lru_cache(maxsize=32)
def _zipf_cdf(n: int, exponent: float) -> NDArray[np.float64]:
    """Cumulative distribution of ranks 1..n with P(rank r) ∝ r^-exponent."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    cdf.flags.writeable = False
    return cdf


def _zipf_ranks(cdf: NDArray[np.float64], uniforms: NDArray[np.float64]) -> NDArray[np.int64]:
    """0-based Zipf ranks by inverse-CDF lookup of ``uniforms`` in [0, 1)."""
    return np.searchsorted(cdf, uniforms, side="right").astype(np.int64, copy=False)


@lru_cache(maxsize=32)
def _permutation(seed: int, kind_code: int, purpose: int, n: int) -> NDArray[np.int64]:
    """A seeded permutation of 0..n-1 (a rank → id mapping)."""
    rng = np.random.default_rng([seed, kind_code, _STREAM_LAYOUT, purpose, n])
    perm = rng.permutation(n).astype(np.int64)
    perm.flags.writeable = False
    return perm


def _mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """SplitMix64 finaliser: a stateless hash, so a table entry for any epoch can
    be computed directly instead of replaying every earlier epoch."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class PairsWorkload(_StreamSpec):
    """The synthetic workload of paper 000 §4.2: tuples ``(i, j, padding)``.

    ``i`` is uniform in 1..n_keys. A share ``locality`` of the tuples have
    ``j == i``, the paper's "locality parameter controls the number of tuples in
    which these integers are equal"; the other tuples take ``j`` uniform among
    the n_keys - 1 other values, so the measured share of equal pairs is exactly
    ``locality`` in expectation (with n_keys == 1 every pair is equal). With
    n_keys equal to the parallelism, routing ``i`` to instance A_i and ``j`` to
    B_j is the paper's locality-aware table. Padding is uniform in
    [pad_min, pad_max] bytes (the paper varies it between 0 and 20 kB).

    With ``relabel_b``, field 2 names its keys through a fixed permutation of
    1..n_keys (the same for every seed, so streams of one workload agree), so
    the pair (i, i) joins two keys with different names. In the
    paper's setting the two fields are different attributes (a hashtag and a
    city); with equal names hash routing would co-locate every local pair by
    accident, and a locality-aware table would have nothing to win.
    """

    kind: Literal["pairs"] = "pairs"
    n_keys: int = Field(
        default=1_000, ge=1, le=MAX_KEYS, description="Keys are 1..n_keys in both fields."
    )
    locality: float = Field(default=0.8, ge=0.0, le=1.0, description="Share of tuples with j == i.")
    pad_min: int = Field(default=0, ge=0, le=MAX_PAD_BYTES, description="Smallest padding, bytes.")
    pad_max: int = Field(default=0, ge=0, le=MAX_PAD_BYTES, description="Largest padding, bytes.")
    pad_fill: PadFill = Field(
        default="repeated",
        description="Padding of one repeated character, or of characters that do not compress.",
    )
    relabel_b: bool = Field(
        default=False, description="Field 2 names keys by a fixed permutation of 1..n_keys."
    )

    @model_validator(mode="after")
    def _check_padding(self) -> PairsWorkload:
        if self.pad_min > self.pad_max:
            raise ValueError(f"pad_min ({self.pad_min}) must not exceed pad_max ({self.pad_max})")
        return self

    def _generate(
        self, start: int, size: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]:
        a = rng.integers(1, self.n_keys + 1, size=size, dtype=np.int64)
        local = rng.random(size) < self.locality
        if self.n_keys > 1:
            other = rng.integers(1, self.n_keys, size=size, dtype=np.int64)
            other += other >= a
            b = np.where(local, a, other)
        else:
            b = a.copy()
        if self.relabel_b:
            names = np.random.default_rng([self._kind_code(), self.n_keys]).permutation(self.n_keys)
            b = names[b - 1] + 1
        if self.pad_max > self.pad_min:
            pad = rng.integers(self.pad_min, self.pad_max + 1, size=size, dtype=np.int32)
        else:
            pad = np.full(size, self.pad_min, dtype=np.int32)
        return a, b, pad

    def _pad_fill(self) -> PadFill:
        return self.pad_fill


class ZipfEvolvingWorkload(_StreamSpec):
    """A Zipf stream whose hot set moves, after the time-evolving synthetic data
    set of paper 001 §6 (first 80 % of the tuples with one Zipf law, the rest
    with the key ranks shifted so that different keys are hot).

    Field 1 (``a``, keys 0..n_keys-1): rank r in 1..n_keys is drawn with
    P(r) ∝ r^-exponent (finite support) and mapped to a key through a seeded
    rank → key table. The stream is cut into segments at ``shift_positions()``
    (``round(fraction * n_events)`` for each fraction in ``shifts``). At each
    shift the table is rebuilt so that the new top half of the ranks is the old
    bottom half of the keys, reshuffled, and the old top half is reshuffled into
    the bottom ranks: every previously hot key becomes cold and the new hot keys
    were cold, which is paper 001's "key + offset" construction without its
    return to the original hot set after two shifts.

    Field 2 (``b``): the coarse category ``a % n_categories``, with
    n_categories defaulting to ``max(1, n_keys // 100)``; a downstream grouping
    whose skew is inherited from field 1, as a per-category aggregate would be.
    """

    kind: Literal["zipf-evolving"] = "zipf-evolving"
    n_keys: int = Field(default=10_000, ge=1, le=MAX_KEYS, description="Keys are 0..n_keys-1.")
    exponent: float = Field(
        default=1.0,
        ge=0.0,
        le=100.0,
        description="Zipf exponent s; large values pin the rank-1 key.",
    )
    shifts: tuple[float, ...] = Field(
        default=(0.8,), description="Stream fractions where the hot set moves; in (0, 1), sorted."
    )
    n_categories: int | None = Field(
        default=None, ge=1, description="Field-2 categories; default max(1, n_keys // 100)."
    )

    @model_validator(mode="after")
    def _check_shifts(self) -> ZipfEvolvingWorkload:
        for fraction in self.shifts:
            if not 0.0 < fraction < 1.0:
                raise ValueError(
                    f"shifts must be fractions of the stream strictly inside (0, 1), got {fraction}"
                )
        if any(later <= earlier for earlier, later in pairwise(self.shifts)):
            raise ValueError(f"shifts must be strictly increasing, got {list(self.shifts)}")
        return self

    @property
    def categories(self) -> int:
        """Number of field-2 values actually used."""
        return self.n_categories if self.n_categories is not None else max(1, self.n_keys // 100)

    def shift_positions(self) -> list[int]:
        """Index of the first event of each segment after the first."""
        return [round(fraction * self.n_events) for fraction in self.shifts]

    def hot_keys(self, segment: int, top: int) -> NDArray[np.int64]:
        """The ``top`` most likely keys of ``segment`` (0 = before the first
        shift), most likely first."""
        n_segments = len(self.shifts) + 1
        if not 0 <= segment < n_segments:
            raise ValueError(f"segment must be in [0, {n_segments}), got {segment}")
        if top < 0:
            raise ValueError(f"top must be >= 0, got {top}")
        return self._mappings()[segment][:top].copy()

    def _mappings(self) -> tuple[NDArray[np.int64], ...]:
        return _zipf_rank_tables(self.seed, self.n_keys, len(self.shifts) + 1)

    def _generate(
        self, start: int, size: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]:
        ranks = _zipf_ranks(_zipf_cdf(self.n_keys, self.exponent), rng.random(size))
        tables = self._mappings()
        bounds = [start, *(p for p in self.shift_positions() if start < p < start + size)]
        bounds.append(start + size)
        first_segment = sum(p <= start for p in self.shift_positions())
        a = np.empty(size, dtype=np.int64)
        for offset, (lo, hi) in enumerate(pairwise(bounds)):
            a[lo - start : hi - start] = tables[first_segment + offset][
                ranks[lo - start : hi - start]
            ]
        return a, a % self.categories, np.zeros(size, dtype=np.int32)


@lru_cache(maxsize=16)
def _zipf_rank_tables(seed: int, n_keys: int, n_segments: int) -> tuple[NDArray[np.int64], ...]:
    """Rank → key tables, one per segment (see ``ZipfEvolvingWorkload``)."""
    rng = np.random.default_rng([seed, _KIND_CODE["zipf-evolving"], _STREAM_MAPPING, n_keys])
    table = rng.permutation(n_keys).astype(np.int64)
    tables = [table]
    half = n_keys // 2
    for _ in range(1, n_segments):
        previous = tables[-1]
        table = np.concatenate([rng.permutation(previous[half:]), rng.permutation(previous[:half])])
        tables.append(table)
    for t in tables:
        t.flags.writeable = False
    return tuple(tables)


def _zero_is_none(value: object) -> object:
    """``flash_every`` 0 means no flashes, like None: a command line has no None to type."""
    return None if value == 0 and not isinstance(value, bool) else value


class GeoTagsWorkload(_StreamSpec):
    """A (region, hashtag) stream shaped like paper 000's Twitter data set
    (§4.3: routed first by location, then by hashtag; associations between tags
    and locations vary over time, with transient ones that only an online
    reconfiguration can exploit).

    Field 1 (``a``): region 0..n_regions-1, Zipf(region_exponent) popularity
    through a seeded rank → region table. Field 2 (``b``): hashtag
    0..n_tags-1, drawn as follows.

    * With probability ``affinity`` the tag is one of the region's
      ``favourites_per_region`` favoured tags, the slot picked with
      Zipf(favourite_exponent): the strong region → tag association that
      locality-aware routing exploits (paper 000 §3).
    * Otherwise it is a background tag, Zipf(tag_exponent) over all tags
      through a seeded rank → tag table (globally trending tags shared by all
      regions, which routing can co-locate with one region at most).
    * Drift: the stream is cut into epochs of ``drift_every`` events. Each
      favourite slot is replaced by a fresh random tag once every
      ``1 / drift_share`` epochs (slots have random phases, so a share
      ``drift_share`` of each region's favourites changes at every epoch
      boundary), except the ``stable_favourites`` most likely slots, which
      never change. A table trained on an old window thus loses its hits
      progressively, down to what the stable associations give, while one
      retrained on a recent window keeps them (paper 000 §4.3, Figure 11a:
      offline settles near 40 % locality, online stays near 50 %). With the
      default ``stable_favourites=0`` an old table's hits fall to chance after
      ``1 / drift_share`` epochs; ``stable_favourites=3`` gives the paper's
      shape, an old table keeping a part of a retrained one's hits.
    * Flash events: in each period of ``flash_every`` events one tag (random,
      so usually cold) becomes, for ``flash_duration`` events starting at a
      random offset, the tag of a share ``flash_share`` of the events of
      ``flash_regions`` random regions (paper 000 Figure 10: one hashtag
      correlated with different states on different days).

    Favourite tags are drawn independently per region, so two regions
    occasionally share a favourite; that is realistic and caps the locality
    any routing can reach a little below ``affinity``.
    """

    kind: Literal["geo-tags"] = "geo-tags"
    n_regions: int = Field(default=50, ge=1, le=MAX_REGIONS, description="Regions (field-1 keys).")
    n_tags: int = Field(default=10_000, ge=1, le=MAX_KEYS, description="Hashtags (field-2 keys).")
    region_exponent: float = Field(default=0.8, ge=0.0, le=10.0, description="Region skew.")
    tag_exponent: float = Field(default=1.0, ge=0.0, le=10.0, description="Background tag skew.")
    favourites_per_region: int = Field(default=20, ge=1, description="Favoured tags per region.")
    favourite_exponent: float = Field(
        default=1.0, ge=0.0, le=10.0, description="Skew over a region's favourite slots."
    )
    affinity: float = Field(
        default=0.8, ge=0.0, le=1.0, description="Share of events carrying a favourite tag."
    )
    drift_every: int = Field(default=100_000, ge=1, description="Events per drift epoch.")
    drift_share: float = Field(
        default=0.2, ge=0.0, le=1.0, description="Share of favourites replaced per epoch."
    )
    stable_favourites: int = Field(
        default=0, ge=0, description="Leading (most likely) favourite slots that never drift."
    )
    flash_every: Annotated[int | None, BeforeValidator(_zero_is_none)] = Field(
        default=250_000, ge=1, description="Events per flash period; 0 or None disables flashes."
    )
    flash_duration: int = Field(default=20_000, ge=1, description="Events a flash lasts.")
    flash_regions: int = Field(default=3, ge=1, description="Regions a flash touches.")
    flash_share: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Share of those regions' events that carry it."
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> GeoTagsWorkload:
        if self.stable_favourites > self.favourites_per_region:
            raise ValueError(
                f"stable_favourites ({self.stable_favourites}) must not exceed "
                f"favourites_per_region ({self.favourites_per_region})"
            )
        if self.flash_every is not None:
            if self.flash_duration > self.flash_every:
                raise ValueError(
                    f"flash_duration ({self.flash_duration}) must not exceed "
                    f"flash_every ({self.flash_every})"
                )
            if self.flash_regions > self.n_regions:
                default = "" if "flash_regions" in self.model_fields_set else ", the default"
                raise ValueError(
                    f"flash_regions ({self.flash_regions}{default}) must not exceed "
                    f"n_regions ({self.n_regions}): lower flash_regions, or set flash_every "
                    "to 0 to disable flashes"
                )
        return self

    def epoch_of(self, position: int) -> int:
        """Drift epoch containing event ``position``."""
        return position // self.drift_every

    def favourites_at(self, position: int) -> NDArray[np.int64]:
        """The favoured tags in force at event ``position``: shape
        (n_regions, favourites_per_region), slot 0 the most likely. The ground
        truth of the region → tag association, for tests and simulations."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return self._favourites(self.epoch_of(position))

    def flashes(self, start: int, stop: int) -> list[FlashEvent]:
        """Flash events active at some position in [start, stop), in order."""
        if self.flash_every is None or start >= stop:
            return []
        first = max(0, start // self.flash_every - 1)
        last = (stop - 1) // self.flash_every
        found = [self._flash(k) for k in range(first, last + 1)]
        return [f for f in found if f.start < stop and f.stop > start]

    def _flash(self, period: int) -> FlashEvent:
        assert self.flash_every is not None
        rng = np.random.default_rng([self.seed, self._kind_code(), _STREAM_FLASH, period])
        offset = int(rng.integers(0, self.flash_every - self.flash_duration + 1))
        tag = int(rng.integers(0, self.n_tags))
        regions = rng.choice(self.n_regions, size=self.flash_regions, replace=False)
        begin = period * self.flash_every + offset
        return FlashEvent(
            start=begin,
            stop=begin + self.flash_duration,
            tag=tag,
            regions=tuple(int(r) for r in np.sort(regions)),
        )

    def _favourites(self, epoch: int) -> NDArray[np.int64]:
        slots = np.arange(self.n_regions * self.favourites_per_region, dtype=np.uint64)
        base = (self.seed * 0x9E3779B97F4A7C15 + self._kind_code()) % 2**64
        slot_hash = _mix64(slots ^ _mix64(np.array([base], dtype=np.uint64)))
        phase = (slot_hash >> np.uint64(11)).astype(np.float64) * 2.0**-53
        generation = np.floor(epoch * self.drift_share + phase).astype(np.uint64)
        stable = (slots % np.uint64(self.favourites_per_region)) < np.uint64(self.stable_favourites)
        generation[stable] = 0
        tag_hash = _mix64(_mix64(slot_hash ^ np.uint64(0x5DEECE66D)) + generation)
        tags = (tag_hash % np.uint64(self.n_tags)).astype(np.int64)
        return tags.reshape(self.n_regions, self.favourites_per_region)

    def _generate(
        self, start: int, size: int, rng: np.random.Generator
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int32]]:
        code = self._kind_code()
        region_table = _permutation(self.seed, code, 0, self.n_regions)
        tag_table = _permutation(self.seed, code, 1, self.n_tags)
        regions = region_table[
            _zipf_ranks(_zipf_cdf(self.n_regions, self.region_exponent), rng.random(size))
        ]
        favoured = rng.random(size) < self.affinity
        slots = _zipf_ranks(
            _zipf_cdf(self.favourites_per_region, self.favourite_exponent), rng.random(size)
        )
        background = tag_table[
            _zipf_ranks(_zipf_cdf(self.n_tags, self.tag_exponent), rng.random(size))
        ]
        flash_draw = rng.random(size)

        tags = background
        positions = np.arange(start, start + size, dtype=np.int64)
        epochs = positions // self.drift_every
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1) if size else ():
            chosen = favoured & (epochs == epoch)
            tags[chosen] = self._favourites(epoch)[regions[chosen], slots[chosen]]
        for flash in self.flashes(start, start + size):
            hit = (
                (positions >= flash.start)
                & (positions < flash.stop)
                & np.isin(regions, np.array(flash.regions, dtype=np.int64))
                & (flash_draw < self.flash_share)
            )
            tags[hit] = flash.tag
        return regions, tags, np.zeros(size, dtype=np.int32)


WorkloadSpec = Annotated[
    PairsWorkload | ZipfEvolvingWorkload | GeoTagsWorkload, Field(discriminator="kind")
]
"""Any workload spec, told apart by its ``kind``."""

_WORKLOAD_ADAPTER: Final[TypeAdapter[WorkloadSpec]] = TypeAdapter(WorkloadSpec)


def parse_workload(raw: Mapping[str, Any]) -> WorkloadSpec:
    """Validate a plain mapping (from the command line or a config file) into a
    workload spec chosen by its ``kind``; raises pydantic's ValidationError."""
    return _WORKLOAD_ADAPTER.validate_python(dict(raw))

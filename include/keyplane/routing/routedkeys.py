"""Routed keys: put a key on a chosen partition of a Spark stateful operator.

Why this exists. keyplane treats a partition of a stateful operator as an
operator instance, but Spark gives no hook to say "key k goes to partition
p": a stateful operator requires ``HashPartitioning(grouping, P)``, whose
partition is ``Pmod(CollationAwareMurmur3Hash(grouping), P)`` in Spark 4.3
(``Murmur3Hash`` in 3.x), over the same UTF-8 bytes and seed (42) as
``pyspark.sql.functions.hash`` for a default-collation string.

So instead of the key, the job groups by a *routed key*: the key, a separator
and a decimal salt (``"user42#17"``), the salt searched so that the routed
key's hash lands on the wanted partition. It must be the only grouping
column, since Spark chains the hash through several. This implements a
routing table with hash fallback (paper 000 §3.3) and hot-key splitting over
several workers (paper 001 §4.1.2, §5) on top of Spark's own keyed state store.

Hash fallback. A key with no table entry is grouped by itself, so it keeps its
natural partition ``spark_partition(key, P)``. A plain key that contains the
separator could equal another key's routed key (``"a#3"`` versus ``"a"`` with
salt 3), so it is salted too, to its own natural partition; ``original_key``
inverts both forms. Likewise a key that is empty or starts with a character of
:data:`CONTROL_STARTS` (the routed job's control rows, which sort before or
after every key and which the JVM stages rely on) or with :data:`ESCAPE` is
*escaped* to ``ESCAPE + key`` and salted. No key is refused for its value.

Scaled fallback. When only some instances are active (paper 003's scale-in,
:class:`keyplane.routing.config.OperatorRouting`), a key whose natural partition is
inactive is salted onto ``fold_instance(natural)``: inactive partitions are
dealt round robin over the active ones, as Stela deals released machines'
instances (003 §5.3), so one natural partition's keys stay together.

:func:`routed_shares` and :func:`predicted_instance_loads` are the one
prediction of per-instance load that the planner, its backtest, the
snapshot's traffic matrix and the configuration gate all use. ``P`` is the
query's number of state partitions, fixed by ``spark.sql.shuffle.partitions``
when the checkpoint was created. The hash is pure Python and numpy, so the
control plane routes without a JVM; the vectorised salt search hashes only
the bytes after the key's last whole 4-byte block, since Murmur3's state
after the shared prefix is the same for every salt.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from keyplane.routing.config import OperatorRouting

SEPARATOR = "#"
"""Between the key and its salt. Keys may contain it: the salt follows the last one."""

CONTROL_STARTS = ("\x00", "\U0010ffff")
"""What the grouping values of control rows start with, and no key's grouping value does:
NUL sorts before every other string, U+10FFFF (the last code point) after every string that
does not start with it."""

ESCAPE = "\x01"
"""Starts the grouping value of a key that cannot stand for itself (:func:`escaped`)."""

SPARK_HASH_SEED = 42
"""The seed of Spark's ``Murmur3Hash`` and ``HashPartitioning``."""

TRIES_PER_PARTITION = 64
"""Default salt-search bound, as a multiple of ``n``.

Each salt hits a given partition with probability about 1/n, so ``64 n`` misses
in a row happen with probability about ``exp(-64)``: a failure means a bug, not
bad luck.
"""

FOLDS_KEPT = 1 << 15
"""How many hash-fallback grouping values a scaled-in :class:`RoutedKeyTable` keeps.

A key whose natural partition is inactive is salted onto an active one, a
search of about ``n`` hashes, so a table keeps the result for the key's next
tuples. A table lives as long as its Python worker, and a stream's distinct
keys keep coming, so the kept values are bounded: the least recently routed
go first.
"""

_MASK = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_SEPARATOR_BYTES = SEPARATOR.encode("utf-8")
_CANDIDATES_PER_CHUNK = 1 << 20
"""Bounds the memory of one vectorised salt-search step (tens of MB)."""

_Words = npt.NDArray[np.integer[Any]]
"""uint32 at run time; numpy's stubs widen ``uint32_array op int`` to a signed type."""
_Word = TypeVar("_Word", int, _Words)


class SaltNotFoundError(LookupError):
    """No salt within the search bound sends a key to its target partition."""


# Murmur3_x86_32 as Spark implements it (org.apache.spark.unsafe.hash.Murmur3_x86_32).
# Each step works on a Python int or elementwise on a uint32 array, so the
# scalar and the vectorised hash share one definition.


def _rotl(x: _Word, r: int) -> _Word:
    return ((x << r) & _MASK) | (x >> (32 - r))


def _mix_k1(k1: _Word) -> _Word:
    k1 = (k1 * _C1) & _MASK
    k1 = _rotl(k1, 15)
    return (k1 * _C2) & _MASK


def _mix_h1(h1: _Word, k1: _Word) -> _Word:
    h1 = h1 ^ k1
    h1 = _rotl(h1, 13)
    return (h1 * 5 + 0xE6546B64) & _MASK


def _fmix(h1: _Word, length: _Word) -> _Word:
    h1 = h1 ^ length
    h1 = h1 ^ (h1 >> 16)
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 = h1 ^ (h1 >> 13)
    h1 = (h1 * 0xC2B2AE35) & _MASK
    return h1 ^ (h1 >> 16)


def _to_signed(h: int) -> int:
    return h - (1 << 32) if h & 0x80000000 else h


def _hash_bytes(data: bytes, seed: int) -> int:
    """Spark's ``Murmur3_x86_32.hashUnsafeBytes``, as an unsigned 32-bit int.

    Whole 4-byte blocks are read little-endian, as standard Murmur3 does. The
    tail differs from the standard: each trailing byte is sign-extended to an
    int and mixed as a block of its own (``mixK1`` then ``mixH1``). Spark kept
    this for backward compatibility when SPARK-23381 (apache/spark#20630) added
    the standard-tail ``hashUnsafeBytes2`` for ML's feature hashing;
    ``Murmur3Hash``/``CollationAwareMurmur3Hash`` still call ``hashUnsafeBytes``
    for strings in Spark 4.x (checked in the 4.3.0 bytecode).
    """
    h1 = seed
    aligned = len(data) - len(data) % 4
    for block in struct.unpack_from(f"<{aligned // 4}I", data):
        h1 = _mix_h1(h1, _mix_k1(block))
    for byte in data[aligned:]:
        h1 = _mix_h1(h1, _mix_k1((byte - 256 if byte >= 128 else byte) & _MASK))
    return _fmix(h1, len(data))


def spark_hash_string(s: str) -> int:
    """Spark's ``hash(s)`` for a ``StringType`` value (signed 32-bit).

    Equals ``F.hash(F.lit(s))``: ``hashUnsafeBytes`` over the UTF-8 bytes with
    seed 42. Lone surrogates have no UTF-8 form and raise ``UnicodeEncodeError``.
    """
    return _to_signed(_hash_bytes(s.encode("utf-8"), SPARK_HASH_SEED))


def spark_hash_long(v: int) -> int:
    """Spark's ``hash(v)`` for a ``LongType`` value (signed 32-bit).

    ``Murmur3_x86_32.hashLong``: the low then the high 32-bit word as two
    blocks, then finalisation with length 8.
    """
    if not -(1 << 63) <= v < (1 << 63):
        raise ValueError(f"{v} does not fit in a signed 64-bit long")
    word = v & 0xFFFFFFFFFFFFFFFF
    h1 = _mix_h1(SPARK_HASH_SEED, _mix_k1(word & _MASK))
    h1 = _mix_h1(h1, _mix_k1(word >> 32))
    return _to_signed(_fmix(h1, 8))


def spark_partition(s: str, n: int) -> int:
    """The partition Spark's ``HashPartitioning`` gives string ``s``: ``pmod(hash(s), n)``."""
    _check_partition_count(n)
    return spark_hash_string(s) % n


def _mix_rows(h1: _Words, rows: npt.NDArray[np.uint8]) -> _Words:
    """Continue ``hashUnsafeBytes`` from states ``h1`` over equal-length byte rows.

    ``rows`` must start on a 4-byte block boundary of the hashed value. The
    caller finalises with ``_fmix`` and the total length.
    """
    width = rows.shape[1]
    aligned = width - width % 4
    if aligned:
        blocks = np.ascontiguousarray(rows[:, :aligned]).view("<u4").astype(np.uint32)
        for column in range(blocks.shape[1]):
            h1 = _mix_h1(h1, _mix_k1(blocks[:, column]))
    for column in range(aligned, width):
        signed_byte = rows[:, column].view(np.int8).astype(np.uint32)
        h1 = _mix_h1(h1, _mix_k1(signed_byte))
    return h1


def _byte_rows(encoded: Sequence[bytes], width: int) -> npt.NDArray[np.uint8]:
    """Stack byte strings of length ``width`` into a (len(encoded), width) matrix."""
    if width == 0:
        return np.zeros((len(encoded), 0), dtype=np.uint8)
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).reshape(len(encoded), width)


def _groups_by_length(lengths: npt.NDArray[np.int64]) -> Iterator[tuple[int, npt.NDArray[np.intp]]]:
    """Yield (length, indices) for each distinct length."""
    if lengths.size == 0:
        return
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    starts = np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]])
    for begin, end in zip(starts, np.r_[starts[1:], len(order)], strict=True):
        yield int(sorted_lengths[begin]), order[begin:end]


def spark_hash_strings(strings: Sequence[str]) -> npt.NDArray[np.int32]:
    """``spark_hash_string`` of many strings at once, vectorised with numpy.

    Strings are grouped by UTF-8 length so each group is one uint8 matrix and
    Murmur3 runs column by column over all its rows.
    """
    encoded = [s.encode("utf-8") for s in strings]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    hashes = np.empty(len(encoded), dtype=np.uint32)
    for width, indices in _groups_by_length(lengths):
        rows = _byte_rows([encoded[i] for i in indices], width)
        seeds = np.full(len(indices), SPARK_HASH_SEED, dtype=np.uint32)
        hashes[indices] = _fmix(_mix_rows(seeds, rows), np.full_like(seeds, width))
    return hashes.view(np.int32)


def spark_partitions(strings: Sequence[str], n: int) -> npt.NDArray[np.int64]:
    """``spark_partition`` of many strings at once."""
    _check_partition_count(n)
    return spark_hash_strings(strings).astype(np.int64) % n


def routed_key(key: str, salt: int) -> str:
    """The grouping value that carries ``key`` with ``salt``: ``f"{key}#{salt}"``.

    The salt is written in canonical decimal (no sign, no leading zeros), so a
    routed key has exactly one (key, salt) reading; see ``split_routed_key``.
    """
    if isinstance(salt, bool) or salt < 0:
        raise ValueError(f"salt must be a non-negative int, got {salt!r}")
    return f"{key}{SEPARATOR}{salt}"


def split_routed_key(routed: str) -> tuple[str, int]:
    """Invert ``routed_key``: split on the last separator, so keys may contain it."""
    key, separator, salt_text = routed.rpartition(SEPARATOR)
    canonical = salt_text.isascii() and salt_text.isdigit() and str(int(salt_text)) == salt_text
    if not separator or not canonical:
        raise ValueError(f"{routed!r} is not a routed key (key{SEPARATOR}salt)")
    return key, int(salt_text)


def escaped(key: str) -> bool:
    """Whether ``key``'s grouping value starts with :data:`ESCAPE` (module docstring).

    An empty key would sort before the control groups and a key starting with a
    control start would share their key space; a key starting with the escape
    itself is escaped too, so that ``original_key`` has one reading.
    """
    return not key or key.startswith((*CONTROL_STARTS, ESCAPE))


def stands_alone(key: str) -> bool:
    """Whether ``key`` may be its own grouping value: neither a separator nor an escape."""
    return SEPARATOR not in key and not escaped(key)


def salt_prefix(key: str) -> str:
    """What a salt follows in ``key``'s routed keys: the key, escaped if it must be."""
    return ESCAPE + key if escaped(key) else key


def original_key(grouping_key: str) -> str:
    """The key behind a grouping value: a plain key is itself, a routed key is split,
    an escaped key loses its escape."""
    if SEPARATOR not in grouping_key:
        return grouping_key
    key = split_routed_key(grouping_key)[0]
    return key.removeprefix(ESCAPE) if grouping_key.startswith(ESCAPE) else key


def find_salt(key: str, target: int, n: int, start: int = 0, max_tries: int | None = None) -> int:
    """The smallest salt ≥ ``start`` whose routed key lands on partition ``target``.

    Expect about ``n`` tries. Raises ``SaltNotFoundError`` after ``max_tries``
    (default ``TRIES_PER_PARTITION * n``) misses.
    """
    _check_target(target, n)
    tries = _check_search_bounds(start, max_tries, n)
    for salt in range(start, start + tries):
        if spark_partition(routed_key(key, salt), n) == target:
            return salt
    raise SaltNotFoundError(
        f"no salt in [{start}, {start + tries}) sends {key!r} to partition {target} of {n}"
    )


def find_salts(
    keys: Sequence[str],
    targets: Sequence[int] | npt.NDArray[np.integer],
    n: int,
    start: int = 0,
    max_tries: int | None = None,
) -> npt.NDArray[np.int64]:
    """``find_salt`` for many keys at once, vectorised; same results.

    Salts are tried in windows of ``2 n``; only keys still without a hit go on
    to the next window, so the work is about ``2 n`` hashes per key. Each hash
    covers only the bytes after the routed key's last whole block of the
    ``key#`` prefix (at most 3) plus the salt digits, because the Murmur3 state
    after those prefix blocks is computed once per key.
    """
    target_array = np.asarray(targets, dtype=np.int64)
    if target_array.shape != (len(keys),):
        raise ValueError(f"need one target per key: {len(keys)} keys, {target_array.shape} targets")
    _check_partition_count(n)
    if target_array.size and (target_array.min() < 0 or target_array.max() >= n):
        raise ValueError(f"targets must lie in [0, {n})")
    tries = _check_search_bounds(start, max_tries, n)
    prefixes = _SaltPrefixes([key.encode("utf-8") + _SEPARATOR_BYTES for key in keys])
    salts = np.full(len(keys), -1, dtype=np.int64)
    pending = np.arange(len(keys))
    window = 2 * n
    chunk = max(1, _CANDIDATES_PER_CHUNK // window)
    low, end = start, start + tries
    while pending.size and low < end:
        high = min(low + window, end)
        for begin in range(0, pending.size, chunk):
            members = pending[begin : begin + chunk]
            salts[members] = prefixes.first_hits(members, target_array[members], low, high, n)
        pending = pending[salts[pending] < 0]
        low = high
    if pending.size:
        shown = ", ".join(repr(keys[i]) for i in pending[:5])
        raise SaltNotFoundError(
            f"no salt in [{start}, {end}) found for {pending.size} key(s) "
            f"with n={n}, for example {shown}"
        )
    return salts


class _SaltPrefixes:
    """Murmur3 states of ``key#`` prefixes, for hashing many salts per key."""

    def __init__(self, prefixes: Sequence[bytes]) -> None:
        lengths = np.fromiter(map(len, prefixes), dtype=np.int64, count=len(prefixes))
        self.lengths = lengths
        self.states = np.empty(len(prefixes), dtype=np.uint32)
        self.tail_lengths = lengths % 4
        self.tails = np.zeros((len(prefixes), 3), dtype=np.uint8)
        for width, indices in _groups_by_length(lengths):
            rows = _byte_rows([prefixes[i] for i in indices], width)
            aligned = width - width % 4
            seeds = np.full(len(indices), SPARK_HASH_SEED, dtype=np.uint32)
            self.states[indices] = _mix_rows(seeds, rows[:, :aligned])
            self.tails[indices, : width - aligned] = rows[:, aligned:]

    def first_hits(
        self,
        members: npt.NDArray[np.intp],
        targets: npt.NDArray[np.int64],
        low: int,
        high: int,
        n: int,
    ) -> npt.NDArray[np.int64]:
        """For each member key, the smallest salt in [low, high) hitting its target, or -1."""
        found = np.full(len(members), -1, dtype=np.int64)
        for digit_count, run_low, run_high in _decimal_runs(low, high):
            run = np.arange(run_low, run_high, dtype=np.int64)
            digits = _decimal_digits(run, digit_count)
            for tail_length in range(4):
                local = np.flatnonzero((self.tail_lengths[members] == tail_length) & (found < 0))
                if local.size == 0:
                    continue
                keys = members[local]
                rows = np.concatenate(
                    [
                        np.repeat(self.tails[keys, :tail_length], run.size, axis=0),
                        np.tile(digits, (keys.size, 1)),
                    ],
                    axis=1,
                )
                hashed = _mix_rows(np.repeat(self.states[keys], run.size), rows)
                lengths = np.repeat(self.lengths[keys] + digit_count, run.size).astype(np.uint32)
                signed = _fmix(hashed, lengths).view(np.int32).astype(np.int64)
                hits = (signed % n).reshape(keys.size, run.size) == targets[local, None]
                has_hit = hits.any(axis=1)
                found[local[has_hit]] = run_low + hits[has_hit].argmax(axis=1)
        return found


def _decimal_runs(low: int, high: int) -> Iterator[tuple[int, int, int]]:
    """Split [low, high) into runs of salts with equal decimal digit counts."""
    while low < high:
        digit_count = len(str(low))
        run_high = min(high, 10**digit_count)
        yield digit_count, low, run_high
        low = run_high


def _decimal_digits(values: npt.NDArray[np.int64], digit_count: int) -> npt.NDArray[np.uint8]:
    """ASCII decimal digits of ``values`` (all with ``digit_count`` digits), one row each."""
    powers = 10 ** np.arange(digit_count - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] // powers) % 10 + ord("0")).astype(np.uint8)


def _check_partition_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"the number of partitions must be at least 1, got {n}")


def _check_target(target: int, n: int) -> None:
    _check_partition_count(n)
    if not 0 <= target < n:
        raise ValueError(f"target partition {target} is not in [0, {n})")


def _check_search_bounds(start: int, max_tries: int | None, n: int) -> int:
    if start < 0:
        raise ValueError(f"start must be non-negative, got {start}")
    tries = TRIES_PER_PARTITION * n if max_tries is None else max_tries
    if tries < 1:
        raise ValueError(f"max_tries must be at least 1, got {tries}")
    return tries


def fold_instance(natural: int, active: Sequence[int], n: int) -> int:
    """The active instance that takes the keys of partition ``natural`` (003 §5.3).

    An active partition keeps its own keys. The ``j``-th inactive partition
    (ascending) goes to ``active[j % len(active)]``: round robin, so the
    inactive partitions spread evenly over the active ones.
    """
    _check_target(natural, n)
    allowed = sorted(set(active))
    if not allowed or allowed[0] < 0 or allowed[-1] >= n:
        raise ValueError(f"active instances must be a non-empty subset of [0, {n}), got {active}")
    if natural in allowed:
        return natural
    inactive_rank = natural - sum(1 for i in allowed if i < natural)
    return allowed[inactive_rank % len(allowed)]


def fallback_instances(
    keys: Sequence[str], n: int, active: Sequence[int] | None = None
) -> npt.NDArray[np.int64]:
    """The instance the hash fallback sends each of ``keys`` to, as the job routes them.

    ``pmod(hash(key), n)``, folded onto ``active`` when the operator is scaled
    in (:func:`fold_instance`); ``None`` means every instance is active.
    """
    natural = spark_partitions(keys, n)
    if active is None:
        return natural
    fold = np.array([fold_instance(g, active, n) for g in range(n)], dtype=np.int64)
    return fold[natural]


def _routes(
    routing: OperatorRouting, keys: Sequence[str]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """``(row, instance, share)``: each place a key of ``keys`` (by row) sends its tuples.

    A table key sends all of them to its instance (000 §3.3); a hot key sends
    ``1/d`` to each of its d instances (001 §4.1.2: with equal capacities,
    taking the least waiting of the d candidates, 001 §4.2, evens them out);
    any other key takes the hash fallback, folded when scaled in
    (:func:`fallback_instances`, 003 §5.3). A routing built without
    validation may name an instance outside ``[0, P)``: that route carries
    nothing here (the configuration gate's keys suite reports it) instead of
    failing or, for a negative instance, wrapping onto another one.
    """
    p = routing.parallelism
    rows: list[int] = []
    instances: list[int] = []
    shares: list[float] = []
    fallback_rows: list[int] = []
    for row, key in enumerate(keys):
        if key in routing.table:
            rows.append(row)
            instances.append(routing.table[key])
            shares.append(1.0)
        elif key in routing.hot_keys:
            spread = routing.hot_keys[key]
            for instance in spread:
                rows.append(row)
                instances.append(instance)
                shares.append(1.0 / len(spread))
        else:
            fallback_rows.append(row)
    row_array = np.array(rows + fallback_rows, dtype=np.int64)
    instance_array = np.array(instances, dtype=np.int64)
    if fallback_rows:
        fallback = fallback_instances(
            [keys[row] for row in fallback_rows], p, routing.active_instances
        )
        instance_array = np.concatenate([instance_array, fallback])
    share_array = np.concatenate([np.array(shares), np.ones(len(fallback_rows))])
    inside = (instance_array >= 0) & (instance_array < p)
    return row_array[inside], instance_array[inside], share_array[inside]


def routed_shares(routing: OperatorRouting, keys: Sequence[str]) -> npt.NDArray[np.float64]:
    """A ``len(keys) × P`` matrix: the share of each key's tuples on each instance.

    Routed as the job routes them (:func:`_routes`); the per-key form, for
    figures that pair two operators' routes (locality, the traffic matrix)
    or compare two routings of one key (the state a rollout moves).
    """
    rows, instances, shares = _routes(routing, keys)
    matrix = np.zeros((len(keys), routing.parallelism), dtype=np.float64)
    np.add.at(matrix, (rows, instances), shares)
    return matrix


def predicted_instance_loads(
    routing: OperatorRouting, key_loads: Mapping[str, float]
) -> npt.NDArray[np.float64]:
    """Each *active* instance's load when ``key_loads`` is routed as the job will route it.

    The loads whose max/mean 000 §3.1 bounds by α, predicted from the
    configuration, not measured (:func:`keyplane.algorithms.statistics.instance_loads`
    counts the tuples each instance reported). A released instance holds no
    keys by design (003 §5.3) and is left out, so max/mean compares the
    instances that work; so is an active instance outside ``[0, P)`` in a
    routing built without validation. Summed straight from the routes, not
    through :func:`routed_shares`, so memory grows with the keys, not with
    keys × P.
    """
    p = routing.parallelism
    weights = np.fromiter(key_loads.values(), dtype=np.float64, count=len(key_loads))
    rows, instances, shares = _routes(routing, list(key_loads))
    loads = np.bincount(instances, weights=weights[rows] * shares, minlength=p)
    return loads[[i for i in routing.active if 0 <= i < p]].astype(np.float64)


class RoutedKeyTable:
    """Grouping values for a routing table and hot keys over ``n_instances`` partitions.

    ``routing`` maps a key to its instance (paper 000 §3.3); ``hot_keys`` maps a
    hot key to d ≥ 2 distinct instances that each hold partial state (paper 001
    §4.1.2; a merge step combines the partials). A key may not be in both. All
    salts are searched once, vectorised, when the table is built.
    ``active`` restricts the hash fallback to those instances
    (:func:`fold_instance`); ``None`` means all.
    """

    def __init__(
        self,
        *,
        n_instances: int,
        routing: Mapping[str, int],
        hot_keys: Mapping[str, Sequence[int]] | None = None,
        active: Sequence[int] | None = None,
    ) -> None:
        _check_partition_count(n_instances)
        self.active: tuple[int, ...] | None = None
        if active is not None:
            fold_instance(0, active, n_instances)
            if len(set(active)) < n_instances:
                self.active = tuple(sorted(set(active)))
        self._fold_of: tuple[int, ...] = tuple(range(n_instances))
        if self.active is not None:
            self._fold_of = tuple(fold_instance(g, self.active, n_instances) for g in self._fold_of)
        self._folded: OrderedDict[str, str] = OrderedDict()
        self._folded_lock = threading.Lock()
        hot = {} if hot_keys is None else hot_keys
        both = routing.keys() & hot.keys()
        if both:
            raise ValueError(f"keys both tabled and hot: {sorted(both)[:5]}")
        for key, instances in hot.items():
            if len(instances) < 2 or len(set(instances)) != len(instances):
                raise ValueError(f"hot key {key!r} needs ≥ 2 distinct instances, got {instances}")
        search_keys = [*routing.keys()]
        search_targets = [*routing.values()]
        for key, instances in hot.items():
            search_keys.extend([key] * len(instances))
            search_targets.extend(instances)
        for key, target in zip(search_keys, search_targets, strict=True):
            if not 0 <= target < n_instances:
                raise ValueError(f"key {key!r}: instance {target} is not in [0, {n_instances})")
        prefixes = [salt_prefix(key) for key in search_keys]
        salts = find_salts(prefixes, search_targets, n_instances)
        routed = [routed_key(k, int(s)) for k, s in zip(prefixes, salts, strict=True)]
        self.n_instances = n_instances
        self.hot_keys = frozenset(hot)
        self._instances = dict(zip(routed, search_targets, strict=True))
        self._routes: dict[str, tuple[str, ...]] = {}
        position = 0
        for key in routing:
            self._routes[key] = (routed[position],)
            position += 1
        for key, instances in hot.items():
            self._routes[key] = tuple(routed[position : position + len(instances)])
            position += len(instances)

    def route(self, key: str) -> list[str]:
        """The grouping values of ``key``: one if tabled, d if hot, else the hash fallback.

        A key without a table entry keeps its natural partition. It is grouped
        by itself, or, if it contains the separator or is escaped (:func:`escaped`), by a
        routed key salted to that same partition (see the module docstring). When its natural
        partition is inactive, it is salted to :func:`fold_instance`'s.
        """
        routes = self._routes.get(key)
        if routes is not None:
            return list(routes)
        if self.active is None:
            return [key] if stands_alone(key) else [self._fallback_value(key)]
        found = self._kept((key,)).get(key)
        if found is None:
            found = self._fallback_value(key)
            self._keep([(key, found)])
        return [found]

    def entries(self) -> dict[str, list[tuple[str, int]]]:
        """Every tabled and hot key's routes, each with its instance: what the table
        holds beyond the hash fallback, which :mod:`keyplane.routing.exported_tables`
        writes for the JVM router."""
        return {
            key: [(route, self._instances[route]) for route in routes]
            for key, routes in self._routes.items()
        }

    @property
    def fold_of(self) -> tuple[int, ...] | None:
        """:func:`fold_instance` of each natural partition, or ``None`` when every
        instance is active."""
        return None if self.active is None else self._fold_of

    def fallback_instance(self, key: str) -> int:
        """The instance the hash fallback gives ``key`` (folded when scaled in)."""
        return self._fold_of[spark_partition(key, self.n_instances)]

    def route_all(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """:meth:`route` of each distinct key of ``keys``, the hash fallback's salts searched
        at once (:func:`find_salts`), for a reader that routes a chunk of tuples.

        A scaled-in operator's new keys each need a salt search, which costs
        far less done for all of them at once than one at a time, the more so
        the more instances. Kept keys cost the same either way.
        """
        found: dict[str, list[str]] = {}
        fallback: list[str] = []
        for key in dict.fromkeys(keys):
            routes = self._routes.get(key)
            if routes is not None:
                found[key] = list(routes)
            elif self.active is None and stands_alone(key):
                found[key] = [key]
            else:
                fallback.append(key)
        kept = {} if self.active is None else self._kept(fallback)
        searched = [key for key in fallback if key not in kept]
        values = self._fallback_values(searched)
        if self.active is not None:
            self._keep(zip(searched, values, strict=True))
        found.update((key, [value]) for key, value in kept.items())
        found.update((key, [value]) for key, value in zip(searched, values, strict=True))
        return found

    def _salt_target(self, key: str, natural: int) -> int | None:
        """The partition the hash fallback salts ``key`` onto, or ``None`` to group it by itself.

        ``natural`` is the key's own partition. The fallback keeps it (000
        §3.3) unless it is inactive, when the key is salted onto its fold
        (:func:`fold_instance`, 003 §5.3); a key containing the separator, or
        escaped, is salted even onto its natural partition, so that it cannot pass for
        another key's routed key (see the module docstring). The one rule
        of both :meth:`_fallback_value` and :meth:`_fallback_values`.
        """
        target = self._fold_of[natural]
        if target == natural and stands_alone(key):
            return None
        return target

    def _fallback_value(self, key: str) -> str:
        """The grouping value the hash fallback gives ``key``, its salt searched alone.

        :meth:`_fallback_values` of one key, but searched by :func:`find_salt`:
        for a single key, :func:`find_salts`' vectorised search costs more
        than it saves.
        """
        target = self._salt_target(key, spark_partition(key, self.n_instances))
        if target is None:
            return key
        prefix = salt_prefix(key)
        return routed_key(prefix, find_salt(prefix, target, self.n_instances))

    def _fallback_values(self, keys: Sequence[str]) -> list[str]:
        """The grouping values the hash fallback gives ``keys``, salts searched at once."""
        natural = spark_partitions(keys, self.n_instances).tolist()
        targets = map(self._salt_target, keys, natural)
        salted = [(i, target) for i, target in enumerate(targets) if target is not None]
        prefixes = [salt_prefix(keys[i]) for i, _ in salted]
        salts = find_salts(prefixes, [target for _, target in salted], self.n_instances)
        values = list(keys)
        for (i, _), prefix, salt in zip(salted, prefixes, salts.tolist(), strict=True):
            values[i] = routed_key(prefix, salt)
        return values

    def _kept(self, keys: Iterable[str]) -> dict[str, str]:
        """The kept fallback values of those of ``keys`` that have one, now the most
        recently used."""
        found: dict[str, str] = {}
        with self._folded_lock:
            for key in keys:
                value = self._folded.get(key)
                if value is not None:
                    self._folded.move_to_end(key)
                    found[key] = value
        return found

    def _keep(self, folded: Iterable[tuple[str, str]]) -> None:
        """Keep fallback values, dropping the least recently used past :data:`FOLDS_KEPT`.

        Under a lock: the driver plans a version's hand-offs, which route
        keys, on a thread of its own while its main thread may route on the
        same table (:mod:`keyplane.spark.routed_source`).
        """
        with self._folded_lock:
            for key, value in folded:
                self._folded[key] = value
                self._folded.move_to_end(key)
            while len(self._folded) > FOLDS_KEPT:
                self._folded.popitem(last=False)

    def instance_of(self, grouping_key: str) -> int:
        """The instance (partition) that Spark sends ``grouping_key`` to."""
        instance = self._instances.get(grouping_key)
        if instance is not None:
            return instance
        return spark_partition(grouping_key, self.n_instances)

    def instances_of(self, grouping_keys: Sequence[str]) -> list[int]:
        """:meth:`instance_of` of many grouping values, the unsalted ones hashed at once."""
        found = [self._instances.get(key) for key in grouping_keys]
        unknown = [i for i, instance in enumerate(found) if instance is None]
        hashed = spark_partitions([grouping_keys[i] for i in unknown], self.n_instances)
        for i, instance in zip(unknown, hashed.tolist(), strict=True):
            found[i] = instance
        return cast(list[int], found)

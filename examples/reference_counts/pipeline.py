"""The reference two-stage running count, as ``make demo`` and the benchmarks run it.

It is the library's default pipeline (``KEYPLANE_PIPELINE``), so its
definition lives in the package, :mod:`keyplane.reference.pipeline`, written
with the same public API as the other examples; this module names it for
``keyplane job start --pipeline examples.reference_counts.pipeline:counts``.
"""

from keyplane.reference.pipeline import EVENT_SCHEMA, counts

__all__ = ["EVENT_SCHEMA", "counts"]

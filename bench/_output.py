"""How every benchmark reports: its result table on stdout and, with ``--out``, in a file.

Kept apart from ``_harness`` so that the pure simulations report the same way
without importing Kafka or PySpark.
"""

from __future__ import annotations

import os
from pathlib import Path


def load_average() -> str:
    """The machine's 1, 5 and 15-minute load averages, as ``uptime`` shows them."""
    return ", ".join(f"{load:.2f}" for load in os.getloadavg())


def emit(text: str, out: Path | None) -> None:
    """Print the result table and, with ``--out``, keep it as a file."""
    print(text)
    if out is not None:
        out.write_text(text + "\n")

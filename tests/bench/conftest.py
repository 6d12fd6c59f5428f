"""Benchmark modules, imported from ``bench/`` as its scripts import each other."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``bench_module(name)``: ``bench/<name>.py`` imported afresh, with ``bench/`` on the path.

    Afresh, so that a module that reads the environment when imported sees
    what the test set.
    """

    def load(name: str) -> ModuleType:
        monkeypatch.syspath_prepend(str(BENCH))
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load

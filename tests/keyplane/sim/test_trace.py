from dataclasses import dataclass

import numpy as np
import pytest

from keyplane.sim.trace import Trace


@dataclass
class FakeBatch:
    a: np.ndarray
    b: np.ndarray
    pad: int


def test_from_fake_batches_concatenates_fields_and_sizes_with_limit() -> None:
    batches = [
        FakeBatch(np.array([1, 2, 3]), np.array([4, 5, 6]), 10),
        FakeBatch(np.array([7, 8, 9]), np.array([1, 1, 1]), 20),
    ]
    trace = Trace.from_batches(iter(batches), limit=5, base_bytes=100)
    assert len(trace) == 5
    assert trace.fields[0].tolist() == [1, 2, 3, 7, 8]
    assert trace.fields[1].tolist() == [4, 5, 6, 1, 1]
    assert trace.sizes is not None
    assert trace.sizes.tolist() == [110, 110, 110, 120, 120]


def test_windows_cover_the_trace_in_order() -> None:
    trace = Trace(fields=(np.arange(10),))
    windows = list(trace.windows(3))
    assert [w.fields[0].tolist() for w in windows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Trace(fields=())
    with pytest.raises(ValueError, match="field 1"):
        Trace(fields=(np.arange(3), np.arange(4)))
    with pytest.raises(ValueError, match="non-decreasing"):
        Trace(fields=(np.arange(3),), times=np.array([0.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="sizes"):
        Trace(fields=(np.arange(3),), sizes=np.array([1.0, -1.0, 0.0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_times_and_sizes_must_be_finite(bad: float) -> None:
    # Regression: a NaN time passed the order check (NaN < 0 is False).
    with pytest.raises(ValueError, match="times must be finite"):
        Trace(fields=(np.arange(3),), times=np.array([0.0, bad, 2.0]))
    with pytest.raises(ValueError, match="sizes must be finite"):
        Trace(fields=(np.arange(3),), sizes=np.array([1.0, bad, 0.0]))

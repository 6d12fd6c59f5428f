"""Tests of the locality planner's knobs (paper 000 §3.1, §4.3)."""

from __future__ import annotations

import pytest

from keyplane.algorithms.plan_settings import PlanSettings


def test_settings_reject_bad_values_and_derive_the_metis_ufactor() -> None:
    assert PlanSettings(4, alpha=1.03).metis_ufactor == 30
    assert PlanSettings(4, alpha=1.0).metis_ufactor == 1
    with pytest.raises(ValueError, match="alpha"):
        PlanSettings(4, alpha=0.9)
    with pytest.raises(ValueError, match="n_instances"):
        PlanSettings(0)
    with pytest.raises(ValueError, match="max_table_entries"):
        PlanSettings(2, max_table_entries=-1)

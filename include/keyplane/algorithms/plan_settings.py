"""The locality planner's knobs, validated once (paper 000 §3.1, §4.3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from keyplane.algorithms.costmodel import CostModel

HeavyKeyPolicy = Literal["split", "pin"]
HeavyRule = Literal["mean", "cascade"]
SplitRule = Literal["pays", "alpha"]


@dataclass(frozen=True)
class PlanSettings:
    """Knobs of :func:`~keyplane.algorithms.locality.build_plan`, validated once.

    ``alpha`` is 000 §3.1's imbalance bound (1.03 is METIS' default tolerance,
    000 §4.3). ``max_table_entries`` bounds each stage's table (the routing
    table lives in every upstream task); ``None`` means no bound.
    ``heavy_rule`` and ``split_rule`` choose how keys are given to the
    splitter (:mod:`keyplane.algorithms.rebalancing`); ``cost`` is the model a split must pay under.
    """

    n_instances: int
    alpha: float = 1.03
    max_table_entries: int | None = None
    seed: int = 0
    heavy_key_policy: HeavyKeyPolicy = "split"
    heavy_rule: HeavyRule = "mean"
    split_rule: SplitRule = "pays"
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.n_instances < 1:
            raise ValueError(f"n_instances must be ≥ 1, got {self.n_instances}")
        if not np.isfinite(self.alpha) or self.alpha < 1.0:
            raise ValueError(f"alpha is an imbalance bound and must be ≥ 1, got {self.alpha}")
        if self.max_table_entries is not None and self.max_table_entries < 0:
            raise ValueError(f"max_table_entries must be ≥ 0 or None, got {self.max_table_entries}")
        if self.heavy_key_policy not in ("split", "pin"):
            raise ValueError(
                f"heavy_key_policy must be 'split' or 'pin', got {self.heavy_key_policy!r}"
            )
        if self.heavy_rule not in ("mean", "cascade"):
            raise ValueError(f"heavy_rule must be 'mean' or 'cascade', got {self.heavy_rule!r}")
        if self.split_rule not in ("pays", "alpha"):
            raise ValueError(f"split_rule must be 'pays' or 'alpha', got {self.split_rule!r}")

    @property
    def metis_ufactor(self) -> int:
        """METIS' load tolerance in thousandths: α = 1.03 → 30 (at least 1)."""
        return max(1, round((self.alpha - 1.0) * 1000))

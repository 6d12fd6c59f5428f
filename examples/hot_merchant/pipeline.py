"""A one-stage skewed aggregation: payments per merchant, where one merchant is most of them.

Each event is a payment ``{"merchant": "m3", "cents": 1250}``. With one
stage there is no locality to win; what keyplane does here is split the hot
merchant's key over several instances (paper 001 §4.1.2), so that no single
task receives half the stream, and merge its partial sums before the sink.

Run it with ``keyplane job start --pipeline examples.hot_merchant.pipeline:payments``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from keyplane import KafkaSource, ParquetSink, Pipeline, Stage


class CentsTotal:
    """Total cents and payment count of a merchant. Integers, so a split key's partial
    sums add up exactly in any order (floating-point sums would not)."""

    def zero(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, state: tuple[int, int], values: Sequence[str]) -> tuple[int, int]:
        return (state[0] + sum(int(v) for v in values), state[1] + len(values))

    def merge(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return (a[0] + b[0], a[1] + b[1])

    def result(self, state: tuple[int, int]) -> dict[str, int]:
        return {"cents": state[0], "payments": state[1]}

    def encode(self, state: tuple[int, int]) -> str:
        return f"{state[0]},{state[1]}"

    def decode(self, text: str) -> tuple[int, int]:
        cents, payments = text.split(",")
        return (int(cents), int(payments))


def payments() -> Pipeline:
    """The pipeline; the topic and output folder come from the environment, with defaults."""
    return Pipeline(
        name="payments",
        source=KafkaSource(
            topics=(os.environ.get("PAYMENTS_TOPIC", "payments"),),
            schema="merchant STRING, cents LONG",
        ),
        stages=(Stage("merchants", key="merchant", value="cents", aggregate=CentsTotal()),),
        sink=ParquetSink(os.environ.get("PAYMENTS_OUTPUT", "var/payments/results")),
    )

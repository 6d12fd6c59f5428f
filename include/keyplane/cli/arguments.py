"""The argument types of the command line: each refuses a bad value in one line naming
the range it accepts, before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from keyplane.kafka.admin import TopicError, check_topic_name

_Number = TypeVar("_Number", int, float)


def _bounded(
    parse: Callable[[str], _Number],
    what: str,
    *,
    above: _Number | None = None,
    at_least: _Number | None = None,
    at_most: _Number | None = None,
) -> Callable[[str], _Number]:
    """An argparse type: ``parse``'s value of the text if it lies within every bound
    given, else an error naming ``what`` the argument must be.

    Each bound is a keyword so that a call site reads as the range it accepts
    (``at_least=1, at_most=65535``), an open end (``above=0.0``) included.
    """

    def convert(text: str) -> _Number:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (
            (above is not None and not value > above)
            or (at_least is not None and not value >= at_least)
            or (at_most is not None and not value <= at_most)
        ):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return convert


def _finite(text: str) -> float:
    """``float(text)``, refusing ``inf`` as it does ``nan``: neither is a rate."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite")
    return value


def _topic(text: str) -> str:
    """An argparse type: a topic name Kafka accepts (:func:`check_topic_name`)."""
    try:
        return check_topic_name(text)
    except TopicError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_TOPIC_NAME_HELP = "1 to 249 letters, digits, '.', '_' or '-'"


_version = _bounded(int, "a version (an integer from 1)", at_least=1)


_count = _bounded(int, "a positive integer", at_least=1)


_port = _bounded(int, "a port (an integer from 1 to 65535)", at_least=1, at_most=65535)


_rate = _bounded(_finite, "a positive number of events per second", above=0.0)


_seconds = _bounded(float, "a positive number of seconds", above=0.0)


_seconds_or_zero = _bounded(float, "a number of seconds, 0 or more", at_least=0.0)

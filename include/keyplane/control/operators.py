"""The managed job's stateful operators, by name, upstream first: the pipeline's stages.

Every stage of the configured pipeline (``KEYPLANE_PIPELINE``,
:attr:`keyplane.pipeline.Pipeline.stage_names`) is a keyed operator whose
keys keyplane routes. The rollout order (000 §3.4 migrates the upstream
operator first), scaling, the quality suites, the statistics and the DAGs
all list them from here. Airflow imports the DAG files, and so this module,
every time it parses them: the pipeline is loaded once per process and
``spec``, and nothing else is imported until it is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache


def stage_names(spec: str | None = None) -> tuple[str, ...]:
    """The stages of the pipeline ``spec`` names (default: the configured one), upstream first.

    A pipeline that cannot be loaded raises
    :class:`keyplane.pipeline.PipelineError`, one line naming the problem.
    """
    if spec is None:
        from keyplane.settings import Settings

        spec = Settings().pipeline
    return _stage_names(spec)


@cache
def _stage_names(spec: str) -> tuple[str, ...]:
    from keyplane.pipeline import load_pipeline

    return load_pipeline(spec).stage_names


def check_operators(operators: Iterable[str], stages: Sequence[str]) -> tuple[str, ...]:
    """``operators`` if each is one of ``stages``; else a ``ValueError`` naming the ones
    that are not, and the pipeline's stages."""
    chosen = tuple(operators)
    unknown = [name for name in chosen if name not in stages]
    if unknown:
        raise ValueError(
            f"operator(s) {', '.join(repr(n) for n in unknown)} are not stages of the "
            f"pipeline; its stages are {', '.join(stages)}"
        )
    return chosen


def __getattr__(name: str) -> tuple[str, ...]:
    """``OPERATORS``: :func:`stage_names` of the configured pipeline, read when first used.

    For modules that list the operators at import time; new code calls
    :func:`stage_names`, which also takes a pipeline other than the configured one.
    """
    if name == "OPERATORS":
        return stage_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

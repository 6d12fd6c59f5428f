"""The routed job's pid file record and the errors of the job's commands.

``<home>/job/job.pid`` records the job's pid, command line, start time,
checkpoint and output, so that ``keyplane job stop`` and ``status`` in another
shell find the job a ``start`` launched. The command line is the job's own
settings, so what it runs (aggregates, pipeline, topic) is read from it
without PySpark or the user's modules.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from keyplane.aggregates import canonical_spec
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE

AGGREGATE_FLAGS = {FIRST_STAGE: "--stage-a-aggregate", SECOND_STAGE: "--stage-b-aggregate"}
"""The job's command-line flag of each stage's keyed aggregate (``keyplane.spark.counts_job``)."""


class JobError(RuntimeError):
    """A job operation failed; the message (one line) says what to do about it."""


class JobExited(JobError):
    """The job exited before it was up; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: tuple[str, ...]) -> None:
        super().__init__(message)
        self.log_tail = log_tail


class JobRecord(BaseModel):
    """The pid file: which process runs the job, and where this run's log begins.

    ``log_offset`` is the size of the log when the run started, so that
    ``status`` never shows a progress line of an earlier run as this one's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(ge=1)
    command: tuple[str, ...]
    started_at: AwareDatetime
    checkpoint: Path
    output: Path
    log_offset: int = Field(default=0, ge=0)

    def flags(self) -> dict[str, str]:
        """The job's ``--flag=value`` options as its command line has them."""
        flags = {}
        for arg in self.command:
            flag, equals, value = arg.partition("=")
            if flag.startswith("--") and equals:
                flags[flag] = value
        return flags

    def aggregates(self) -> dict[str, str | None]:
        """Each stage's ``module:attr`` as the job's command line names it; None: the default.

        Read from the recorded command, the job's own settings, so that
        ``status`` needs neither PySpark nor the user's module to say it.
        """
        flags = self.flags()
        return {stage: canonical_spec(flags.get(flag)) for stage, flag in AGGREGATE_FLAGS.items()}

    def pipeline(self) -> str | None:
        """The ``module:attr`` of the pipeline the job runs; None: the reference one."""
        return self.flags().get("--pipeline")

    def events_topic(self) -> str | None:
        """The topic the job reads, as its command line names it."""
        return self.flags().get("--events-topic")


def describe_aggregates(aggregates: dict[str, str | None]) -> str:
    """The stages' aggregates in words: "A the running count, B myjob.aggregates:Distinct"."""
    return ", ".join(
        f"{stage} {spec or 'the running count'}" for stage, spec in sorted(aggregates.items())
    )

"""``keyplane stack up|down|status``: production on one machine."""

from __future__ import annotations

import argparse

from keyplane.cli.display import _line
from keyplane.cli.errors import CliError
from keyplane.settings import Settings


def cmd_stack(settings: Settings, args: argparse.Namespace) -> int:
    """Production on one machine: Kafka, Spark standalone, PostgreSQL, Airflow, the job."""
    from keyplane.stack.config import StackConfig
    from keyplane.stack.piece import StackError
    from keyplane.stack.stack import Stack

    stack = Stack(settings, StackConfig(), with_job=not getattr(args, "without_job", False))
    try:
        if args.action == "up":
            stack.up(print)
            print(f"stack up; logs under {stack.home}; `keyplane stack down` stops it")
            return 0
        if args.action == "down":
            stack.down(print)
            return 0
        made, healths = stack.status()
    except (StackError, FileNotFoundError) as error:
        raise CliError(str(error)) from None
    print(_line("network", made.describe()))
    for health in healths:
        state = "up" if health.up else "down"
        print(_line(health.piece, f"{state} at {health.url}: {health.detail}"))
    return 0 if all(health.up for health in healths) else 1

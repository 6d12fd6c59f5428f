"""``keyplane``: the command line of the control plane.

Every long step shows a progress bar; every failure exits non-zero with one
line that says what went wrong and how to fix it.

:func:`main` is the entry point (the ``keyplane`` script and ``python -m
keyplane.cli``); it turns every error a user can cause into that one line.
The grammar is :mod:`keyplane.cli.parser`'s, and each command group lives in
its own module: ``broker``, ``topic``, ``workloads`` (generate, demo),
``job``, ``status``, ``config`` (show, list, diff), ``rollout`` (config
publish, abort), ``airflow`` and ``stack``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kafka.errors import KafkaError
from pydantic import ValidationError

from keyplane.aggregates import AggregateSpecError
from keyplane.cli.errors import CliError
from keyplane.cli.parser import build_parser
from keyplane.control.controller import ControllerError
from keyplane.control.messages import ProtocolError
from keyplane.control.signing import MissingKeyError
from keyplane.kafka.admin import TopicError
from keyplane.kafka.broker import BrokerError
from keyplane.pipeline import PipelineError
from keyplane.routing import config as config_store
from keyplane.settings import Settings
from keyplane.spark.job_record import JobError
from keyplane.util.validation_errors import first_problem


def _config_error_line(error: config_store.ConfigStoreError) -> str:
    """The store's message plus what to do about it, on one line."""
    if isinstance(error, config_store.UnknownVersionError):
        fix = "pass one of the stored versions"
    elif isinstance(error, config_store.ChecksumMismatchError):
        fix = "restore the file from a backup or publish a new version"
    else:
        fix = "check the store directory or publish a new version"
    return f"keyplane: {error}; {fix}".replace("\n", " ")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings()
        return int(args.func(settings, args))
    except ValidationError as exc:
        print(f"keyplane: invalid {first_problem(exc, 'input')}", file=sys.stderr)
    except (
        AggregateSpecError,
        PipelineError,
        BrokerError,
        TopicError,
        CliError,
        ControllerError,
        JobError,
        ProtocolError,
        MissingKeyError,
    ) as exc:
        print(f"keyplane: {exc}", file=sys.stderr)
    except config_store.ConfigStoreError as exc:
        print(_config_error_line(exc), file=sys.stderr)
    except BrokenPipeError:
        # The reader stopped reading (`| head`): what it read is what it wanted. Point
        # stdout at /dev/null so that the interpreter's own flush at exit fails silently.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # A path that is a file where a directory belongs, a full disk, no permission.
        where = f": {exc.filename}" if exc.filename else ""
        print(f"keyplane: {exc.strerror or exc}{where}", file=sys.stderr)
    except KafkaError as exc:
        print(
            f"keyplane: Kafka did not answer ({type(exc).__name__}: {exc}); "
            "is the broker running? `keyplane broker status`",
            file=sys.stderr,
        )
    except KeyboardInterrupt:
        print("keyplane: interrupted", file=sys.stderr)
        return 130
    return 2

"""Helpers for testing keyplane deployments and user jobs.

Shipped with the library (like Bytewax's testing module) so users can write
the same kind of integration tests against their own routed stages.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

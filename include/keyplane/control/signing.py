"""HMAC-SHA256 signatures for control messages (paper 000 §3.4).

The reconfiguration protocol of 000 §3.4 lets the manager rewrite the routing
of a running job and move its state. On a shared Kafka control topic, anyone
who can produce to the topic could do the same, so every control message is
signed with a key only the controller and the job hold, and a message whose
signature does not verify is never acted on.

The signed bytes are canonical JSON — keys sorted, no whitespace, ASCII only,
no NaN or infinity — so the sender and the receiver compute the same bytes
from the same payload whatever order its keys were built or parsed in.

The key comes from ``KEYPLANE_CONTROL_KEY`` unless it is passed explicitly.
Use at least 32 random bytes. This module never logs the key, and no error it
raises includes it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

KEY_ENV_VAR = "KEYPLANE_CONTROL_KEY"


class MissingKeyError(RuntimeError):
    """No key to sign or verify control messages with was configured."""

    def __init__(self) -> None:
        super().__init__(
            "no control-message signing key is configured: set the "
            f"{KEY_ENV_VAR} environment variable (or pass the key explicitly)"
        )


def control_key(key: bytes | str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The signing key: ``key`` if given, else ``KEYPLANE_CONTROL_KEY``.

    A string is taken as UTF-8. An empty key counts as no key, because an
    empty HMAC key authenticates nothing.
    """
    if key is None:
        key = (os.environ if environ is None else environ).get(KEY_ENV_VAR)
    if key is None:
        raise MissingKeyError()
    resolved = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not resolved:
        raise MissingKeyError()
    return resolved


def canonical_json(payload: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: sorted keys, compact separators, ASCII.

    Raises ``ValueError`` for NaN or infinity and ``TypeError`` for values
    JSON cannot carry, since such payloads have no canonical form.
    """
    return json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def sign(payload: Mapping[str, Any], key: bytes | str | None = None) -> str:
    """The HMAC-SHA256 of ``payload``'s canonical JSON, as 64 lowercase hex digits."""
    return hmac.new(control_key(key), canonical_json(payload), hashlib.sha256).hexdigest()


def verify(payload: Mapping[str, Any], signature: object, key: bytes | str | None = None) -> bool:
    """Whether ``signature`` is ``payload``'s signature under ``key``.

    The comparison takes constant time (``hmac.compare_digest``), so timing
    reveals nothing about how much of a forged signature was right. Anything
    that is not a string, or a payload with no canonical form, does not
    verify.
    """
    secret = control_key(key)
    if not isinstance(signature, str):
        return False
    try:
        expected = sign(payload, secret)
    except (TypeError, ValueError):
        return False
    return hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8", "replace"))

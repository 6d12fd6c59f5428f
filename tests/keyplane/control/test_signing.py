"""Tests of keyplane.control.signing: canonical JSON, HMAC-SHA256, and where the key comes from."""

from __future__ import annotations

import hashlib
import hmac
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.control.signing import (
    KEY_ENV_VAR,
    MissingKeyError,
    canonical_json,
    control_key,
    sign,
    verify,
)

KEY = b"0123456789abcdef0123456789abcdef"
OTHER_KEY = b"fedcba9876543210fedcba9876543210"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
payloads = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


def test_canonical_json_sorts_keys_and_has_no_whitespace() -> None:
    assert canonical_json({"b": [1, {"d": 2, "c": "é"}], "a": None}) == (
        b'{"a":null,"b":[1,{"c":"\\u00e9","d":2}]}'
    )


def test_canonical_json_refuses_nan_and_values_json_cannot_carry() -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    with pytest.raises(TypeError):
        canonical_json({"x": b"bytes"})


def test_signature_is_hmac_sha256_of_the_canonical_json_in_hex() -> None:
    payload = {"type": "PREPARE", "config_version": 2}
    expected = hmac.new(KEY, b'{"config_version":2,"type":"PREPARE"}', hashlib.sha256).hexdigest()
    assert sign(payload, KEY) == expected
    assert len(expected) == 64


def test_verify_accepts_the_signature_and_rejects_any_change() -> None:
    payload = {"type": "PROPAGATE", "operator": "A", "config_version": 3}
    signature = sign(payload, KEY)

    assert verify(payload, signature, KEY)
    assert not verify(payload, signature, OTHER_KEY)
    assert not verify({**payload, "operator": "B"}, signature, KEY)
    assert not verify({**payload, "extra": 1}, signature, KEY)
    assert not verify(payload, signature.upper(), KEY)
    assert not verify(payload, signature[:-1], KEY)
    assert not verify(payload, "é" * 64, KEY)
    assert not verify(payload, None, KEY)
    assert not verify(payload, 12345, KEY)
    assert not verify({"x": float("inf")}, signature, KEY)


def test_key_comes_from_the_environment_unless_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV_VAR, "from-the-environment")
    payload = {"a": 1}

    assert control_key() == b"from-the-environment"
    assert control_key("explicit") == b"explicit"
    assert sign(payload) == sign(payload, b"from-the-environment")
    assert sign(payload, KEY) != sign(payload)
    assert verify(payload, sign(payload, "from-the-environment"))


def test_missing_or_empty_key_names_the_variable_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV_VAR, raising=False)
    with pytest.raises(MissingKeyError, match=KEY_ENV_VAR):
        sign({"a": 1})
    with pytest.raises(MissingKeyError, match=KEY_ENV_VAR):
        verify({"a": 1}, "00" * 32)
    monkeypatch.setenv(KEY_ENV_VAR, "")
    with pytest.raises(MissingKeyError, match=KEY_ENV_VAR):
        control_key()
    with pytest.raises(MissingKeyError):
        control_key(b"")
    assert control_key(environ={KEY_ENV_VAR: "abc"}) == b"abc"


def test_errors_never_contain_the_key() -> None:
    secret = "do-not-print-this-key"
    with pytest.raises(TypeError) as caught:
        sign({"x": object()}, secret)
    assert secret not in str(caught.value)
    assert not verify({"x": object()}, "00" * 32, secret)


@settings(max_examples=150, deadline=None)
@given(payload=payloads, seed=st.integers(min_value=0, max_value=2**32))
def test_signature_survives_any_key_order_and_a_json_round_trip(
    payload: dict[str, object], seed: int
) -> None:
    signature = sign(payload, KEY)
    items = list(payload.items())
    random.Random(seed).shuffle(items)
    reordered = json.loads(json.dumps(dict(items), indent=2))

    assert verify(reordered, signature, KEY)
    assert not verify(reordered, signature, OTHER_KEY)


@settings(max_examples=100, deadline=None)
@given(payload=payloads, other=payloads)
def test_different_payloads_have_different_signatures(
    payload: dict[str, object], other: dict[str, object]
) -> None:
    if canonical_json(payload) != canonical_json(other):
        assert not verify(other, sign(payload, KEY), KEY)

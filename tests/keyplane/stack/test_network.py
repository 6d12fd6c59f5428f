"""The stack's network: it never records, and so never removes, another stack's."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyplane.stack.config import StackConfig
from keyplane.stack.network import BRIDGE, _ip, make, why_unshaped
from keyplane.stack.piece import StackError

pytestmark = pytest.mark.integration


def test_make_refuses_a_bridge_that_exists_and_records_nothing(tmp_path: Path) -> None:
    reason = why_unshaped(StackConfig())
    if reason is not None:
        pytest.skip(reason)
    # Another stack's bridge, or one made here for the test (and removed after it).
    made_here = _ip("link", "add", BRIDGE, "type", "bridge", check=False).returncode == 0
    record = tmp_path / "network.json"
    try:
        with pytest.raises(StackError, match=f"{BRIDGE}.* exist already"):
            make(StackConfig(), record)
        assert not record.exists()
        assert _ip("link", "show", BRIDGE, check=False).returncode == 0
    finally:
        if made_here:
            _ip("link", "del", BRIDGE)

"""Hosts of their own for the Spark workers: network namespaces joined by shaped links.

Each worker runs in a namespace with one veth link to a bridge in this
machine's namespace; the bridge holds the address of the master, the
driver and Kafka's external listener. Each end of each link sends through a
``tc`` queue that limits it to ``link_rate`` and delays it by
``link_delay_ms`` (``netem``), so a byte from one executor to another
crosses two shaped links, as between two hosts through a switch. A kernel
without ``netem`` gets the rate alone (``tbf``) and the network says so.

Making namespaces needs root (CAP_NET_ADMIN); without it the stack runs on
loopback, unshaped, and :class:`Network` says why.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from keyplane.stack.config import StackConfig
from keyplane.stack.piece import StackError, euid_is_root
from keyplane.util.processes import write_atomically
from keyplane.util.statefiles import read_model_file

BRIDGE = "kps-br0"


def namespace(index: int) -> str:
    return f"kps-w{index}"


class Network(BaseModel):
    """What ``up`` made (names to remove on ``down``) and how the links are shaped."""

    model_config = ConfigDict(frozen=True)

    shaped: bool
    reason: str = ""
    """Why the stack runs unshaped, or what of the shaping this kernel lacks."""
    bridge: str | None = None
    namespaces: tuple[str, ...] = ()
    shaping: str = ""

    def describe(self) -> str:
        if not self.shaped:
            return f"unshaped, all on loopback: {self.reason}"
        note = f" ({self.reason})" if self.reason else ""
        return (
            f"{len(self.namespaces)} worker hosts on {self.bridge}, each link {self.shaping}{note}"
        )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise StackError(f"network: `ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _tc(
    namespace_name: str | None, device: str, qdisc: list[str]
) -> subprocess.CompletedProcess[str]:
    where = ["-n", namespace_name] if namespace_name else []
    return subprocess.run(
        ["tc", *where, "qdisc", "replace", "dev", device, "root", *qdisc],
        capture_output=True,
        text=True,
        check=False,
    )


def _shape(config: StackConfig, namespace_name: str | None, device: str) -> tuple[str, str]:
    """Shape one link end: ``netem`` rate and delay, else ``tbf`` rate alone with the reason."""
    delay = f"{config.link_delay_ms:g}ms"
    netem = ["netem", "rate", config.link_rate, "delay", delay, "limit", "10000"]
    done = _tc(namespace_name, device, netem)
    if done.returncode == 0:
        return f"{config.link_rate}, {delay} delay (netem)", ""
    tbf = ["tbf", "rate", config.link_rate, "burst", "256kb", "latency", "50ms"]
    fallback = _tc(namespace_name, device, tbf)
    if fallback.returncode != 0:
        raise StackError(f"network: tc cannot shape {device}: {fallback.stderr.strip()}")
    return (
        f"{config.link_rate}, no delay (tbf)",
        f"no {delay} delay: this kernel has no netem queue ({done.stderr.strip()})",
    )


def why_unshaped(config: StackConfig) -> str | None:
    """None when namespaces can be made here, else why not."""
    if config.shaping == "off":
        return "shaping is off (KEYPLANE_STACK_SHAPING=off)"
    if not euid_is_root():
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (install iproute2)"
    probe = "kps-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"this process may not make network namespaces ({done.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def make(config: StackConfig, record: Path) -> Network:
    """The bridge, one namespace per worker and their shaped links; recorded as it goes,
    so that :func:`remove` finds whatever a failure left half made."""
    reason = why_unshaped(config)
    if reason is not None:
        network = Network(shaped=False, reason=reason)
        write_atomically(record, network.model_dump_json())
        return network
    taken = [BRIDGE] if _ip("link", "show", BRIDGE, check=False).returncode == 0 else []
    listed = _ip("netns", "list", check=False).stdout.split()
    taken += [namespace(i) for i in range(1, config.workers + 1) if namespace(i) in listed]
    if taken:
        # Recording them would make this stack's `down` delete another stack's network.
        raise StackError(
            f"network: {', '.join(taken)} exist already: another stack runs on this machine; "
            "stop it (`keyplane stack down` in its home) or set KEYPLANE_STACK_SHAPING=off"
        )
    made: list[str] = []

    def save(shaping: str = "", note: str = "") -> Network:
        network = Network(
            shaped=True, reason=note, bridge=BRIDGE, namespaces=tuple(made), shaping=shaping
        )
        write_atomically(record, network.model_dump_json())
        return network

    save()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{config.address(0)}/{config.prefix_length}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    shaping, note = "", ""
    for index in range(1, config.workers + 1):
        name = namespace(index)
        host_end, inner_end = f"{name}h", f"{name}n"
        _ip("netns", "add", name)
        made.append(name)
        save()
        _ip("link", "add", host_end, "type", "veth", "peer", "name", inner_end)
        _ip("link", "set", inner_end, "netns", name)
        _ip("link", "set", host_end, "master", BRIDGE)
        _ip("link", "set", host_end, "up")
        address = f"{config.address(index)}/{config.prefix_length}"
        _ip("-n", name, "addr", "add", address, "dev", inner_end)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "link", "set", inner_end, "up")
        _ip("-n", name, "route", "add", "default", "via", config.address(0))
        shaping, note = _shape(config, None, host_end)
        _shape(config, name, inner_end)
    return save(shaping, note)


def read(record: Path) -> Network | None:
    return read_model_file(
        record,
        Network,
        what="a stack network file",
        fix="remove it once no kps-* namespace is left (`ip netns list`)",
        error=StackError,
    )


def remove(record: Path) -> list[str]:
    """Delete the namespaces (their veth links go with them) and the bridge that ``make``
    recorded; return what was deleted."""
    network = read(record)
    if network is None:
        return []
    removed: list[str] = []
    for name in network.namespaces:
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    if (
        network.bridge is not None
        and _ip("link", "del", network.bridge, check=False).returncode == 0
    ):
        removed.append(network.bridge)
    record.unlink(missing_ok=True)
    return removed


def left_over() -> list[str]:
    """The stack's namespaces and bridge that exist now (for ``status`` and the tests)."""
    names = _ip("netns", "list", check=False).stdout.split()
    found = [name for name in names if name.startswith("kps-w")]
    if _ip("link", "show", BRIDGE, check=False).returncode == 0:
        found.append(BRIDGE)
    return found

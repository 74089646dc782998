"""A network namespace joined to this one by a veth pair (root only), for tests whose traffic
must cross a network stack: ``with veth_namespace() as (ns, here, there)``."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


@contextlib.contextmanager
def veth_namespace(subnet: str = "10.231.7") -> Iterator[tuple[str, str, str]]:
    """A namespace ``ns`` whose veth has ``there`` (SUBNET.2), joined to this namespace's
    ``here`` (SUBNET.1); both removed after. Skips the test where it cannot be made."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    ns, near, far = f"sw-ns-{tag}", f"swv{tag}a", f"swv{tag}b"
    here, there = f"{subnet}.1", f"{subnet}.2"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot make a network namespace here: {err.stderr.strip()}")
    try:
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", ns)
        _ip("addr", "add", f"{here}/24", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", ns, "addr", "add", f"{there}/24", "dev", far)
        _ip("-n", ns, "link", "set", far, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, here, there
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", near)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", ns)

"""Where a plan's ranks run: the hosts of a multi-machine plan, as the user names them."""

from __future__ import annotations

from dataclasses import dataclass


class HostError(RuntimeError):
    """A host that cannot be reached or answered wrongly; the message names it and what to do."""


@dataclass(frozen=True)
class Host:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``HOST:PORT,HOST:PORT,...`` (the workers' ``--listen`` addresses)."""
    hosts = []
    for item in (t.strip() for t in text.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise HostError(f"--hosts takes HOST:PORT,... (each worker's --listen address), not {item!r}")
        if ":" in host or host.startswith("["):
            raise HostError(f"{item!r} is an IPv6 address: Disco's sockets take IPv4 addresses or host names")
        hosts.append(Host(host.strip("[]"), int(port)))
    if len(set(hosts)) != len(hosts):
        raise HostError(f"--hosts names a worker twice: {text}")
    return tuple(hosts)

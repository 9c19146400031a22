"""Which nodes' agents a node can reach: another node's agent on a loopback address
is reachable only from its own host (nodes simulated on one host share it), which a
probe of its Unix socket tells.
"""

from __future__ import annotations

from distcache._log import get_logger

log = get_logger(__name__)


def _on_loopback(endpoint: str) -> bool:
    import ipaddress

    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _on_this_host(unix: str) -> bool:
    """Whether the agent whose Unix socket is ``unix`` runs on this host: a Unix socket
    takes connections only on its own host (nodes simulated on one host share it)."""
    import socket

    if not unix.startswith("unix:"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(unix[len("unix:"):])
        except OSError:
            return False
    return True


def reachable(entries: list[tuple[str, str, str]], me: str, *,
              tell: bool) -> list[tuple[str, str, str]]:
    """``entries`` (node, TCP endpoint, Unix endpoint) less those of other nodes whose
    agents listen on a loopback address of another host (this node would dial its own
    loopback): such a node goes without an agent in this node's walks. Each node on a
    loopback address that another host cannot reach is named at WARNING when ``tell``."""
    if len({node for node, _, _ in entries}) < 2 or not any(
            _on_loopback(tcp) for _, tcp, _ in entries):
        return entries
    here = {node for node, _, unix in entries if node == me or _on_this_host(unix)}
    kept = [e for e in entries if e[0] in here or not _on_loopback(e[1])]
    unreachable = [(node, tcp) for node, tcp, _ in entries if _on_loopback(tcp) and (
        node not in here or any(other not in here for other, _, _ in entries))]
    if unreachable and tell:
        shown = ", ".join(f"node {node} at {tcp}" for node, tcp in unreachable[:8])
        more = f" and {len(unreachable) - 8} more" if len(unreachable) > 8 else ""
        log.warning("peers: %s%s: a loopback address, which the job's other hosts cannot "
                    "reach; such a node's agent is left out of other hosts' walks (more "
                    "origin requests). An agent listens on the local end of the route to "
                    "MASTER_ADDR, else on the address its host name resolves to: set "
                    "MASTER_ADDR to an address of the job's network, or make the host name "
                    "resolve to the node's network address (not 127.0.x.x in /etc/hosts)",
                    shown, more)
    return kept


def endpoints(entries: list[tuple[str, str, str]], me: str, tell: bool) -> list[str]:
    """The TCP endpoints of :func:`reachable`'s entries."""
    return [tcp for _, tcp, _ in reachable(entries, me, tell=tell)]

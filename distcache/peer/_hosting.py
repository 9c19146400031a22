"""Starting the node agents of a job: once, at start-up, over distcache's communicator.

The lowest rank of each node (``Communicator.node_id``) starts an agent on the
address the job uses (:func:`job_address`) and a Unix socket in the pool directory;
one all-gather through the node leaders shares every node's TCP endpoint and socket.
Each rank then uses its node's agent for lookups; the agents know each other and each
artifact's owner follows from the endpoints alone (:mod:`distcache.peer._ring`), so
serving needs no collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.comm import node_layout, node_tree
from distcache.peer._auth import derive_key
from distcache.peer._tier import Tier, attach, key_path

if TYPE_CHECKING:
    from distcache.comm import Communicator
    from distcache.origins import Origin
    from distcache.peer._agent import Agent
    from distcache.store import ArtifactPool

log = get_logger(__name__)

#: The longest Unix socket path Linux takes (108 bytes with the terminator), with room.
_MAX_SOCKET_PATH = 100


def job_address(environ: Mapping[str, str] | None = None) -> str:
    """The address this host uses for the job: the local end of the route to
    ``MASTER_ADDR`` when that is set, else the address the host name resolves to, else
    loopback. The agent binds this one address, never a wildcard."""
    import socket  # on the node leaders that host an agent

    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))
            return str(s.getsockname()[0])
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def socket_path(pool_root: Path, tag: str) -> Path:
    """Where a node's agent listens for the node's processes: in the pool directory
    when the path fits a Unix socket, else in a private temporary directory."""
    name = f".peer-{hashlib.sha256(tag.encode()).hexdigest()[:12]}.sock"
    path = Path(pool_root) / name
    if len(str(path)) <= _MAX_SOCKET_PATH:
        return path
    import tempfile  # (and shutil, bz2, lzma with it) only for this fallback

    return Path(tempfile.mkdtemp(prefix="distcache-")) / name


class Hosted:
    """What :func:`start` set up on this rank: the agent it hosts (node leaders only),
    the tier its lookups use and every node agent's endpoint. :meth:`close` stops both."""

    def __init__(self, tier: Tier | None, agent: Agent | None = None,
                 nodes: list[str] | None = None) -> None:
        self.tier, self.agent, self.nodes = tier, agent, [] if nodes is None else nodes

    def close(self) -> None:
        attach(None)
        if self.agent is not None:
            self.agent.stop()
            if self.agent.socket_path is not None:
                with contextlib.suppress(OSError):
                    key_path(self.agent.socket_path).unlink()
                _remove_made_dir(self.agent.socket_path, self.agent.pool)
            self.agent = None


def _remove_made_dir(socket: Path, pool: ArtifactPool) -> None:
    """Remove the private directory :func:`socket_path` made for ``socket`` (when the
    pool's path was too long for it), now that the socket and key are gone."""
    if socket.parent != Path(pool.root):
        with contextlib.suppress(OSError):
            socket.parent.rmdir()


def host_agent(pool: ArtifactPool, origin: Callable[[], Origin | None], key: bytes,
               tag: str, environ: Mapping[str, str] | None = None) -> Agent:
    """Start one node agent on :func:`job_address`, with its socket and key file."""
    from distcache.peer._agent import Agent

    path = socket_path(Path(pool.root), tag)
    try:
        agent = Agent(pool, origin, key, host=job_address(environ), socket_path=path).start()
    except BaseException:
        _remove_made_dir(path, pool)
        raise
    keyfile = key_path(path)
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return agent


def start(comm: Communicator, pool: ArtifactPool, origin: Callable[[], Origin | None],
          secret: bytes | None, *, timeout: float | None = None,
          environ: Mapping[str, str] | None = None) -> Hosted | None:
    """Collective: start the node agents of this communicator's job and attach this
    rank's tier; ``None`` (no agent, nothing attached) when every rank is on one node.
    ``secret`` is the run scope's (``None``: rank 0 draws one, shared over ``comm``).

    A node whose agent cannot listen goes without one (a warning; its ranks get no
    tier), and the other nodes leave it out of their walks.

    Raises:
        CollectiveTimeout, CommError: an all-gather failed (on every rank).
    """
    # Through node leaders: the ranks of a node send alike, so what a rank receives
    # follows the nodes, not the ranks (the tree is the one the prefetch uses next).
    # The layout comes with the tree: no collective of its own.
    comm = node_tree(comm, timeout=timeout)
    nodes, leader = node_layout(comm, timeout=timeout)
    if nodes < 2:
        return None
    if secret is None:  # no run scope: rank 0 draws one for this job
        drawn = os.urandom(32) if comm.rank == 0 else None
        secret = comm.broadcast_bytes(drawn, 0, timeout=timeout)
    key = derive_key(secret)
    agent: Agent | None = None
    if leader:
        tag = f"{comm.node_id}/{hashlib.sha256(key).hexdigest()[:16]}"
        try:
            agent = host_agent(pool, origin, key, tag, environ)
        except OSError as exc:
            # The peers still meet at the next all-gather: this node goes without an
            # agent (its lookups ask the origin, as without peers), nobody waits.
            log.warning("peers: no agent on node %s: %s: %s; its lookups go to the origin",
                        comm.node_id, type(exc).__name__, exc)
    mine = (agent.endpoint, agent.local_endpoint or "") if agent is not None else ("", "")
    everyone = comm.allgather_object((comm.node_id, *mine), timeout=timeout)
    leaders = [(str(node), str(tcp), str(unix)) for node, tcp, unix in everyone if tcp]
    endpoints = [tcp for _, tcp, _ in leaders]
    if agent is not None:
        agent.join(endpoints, endpoints.index(agent.endpoint))
    local = next((unix or tcp for node, tcp, unix in leaders if node == comm.node_id), None)
    tier = Tier(local, key) if local is not None else None
    attach(tier)
    if comm.rank == 0:
        log.info("peers: %d node agent(s): %s", len(endpoints), ", ".join(endpoints))
    return Hosted(tier, agent, endpoints)


def start_for_session(comm: Communicator, pool: ArtifactPool, origin: Origin | None,
                      secret: bytes | None, peers: str, *, timeout: float | None = None,
                      environ: Mapping[str, str] | None = None) -> Hosted | None:
    """What ``init`` starts for ``DISTCACHE_PEERS``: ``"1"`` and more than one rank, the
    node agents (:func:`start`); ``"0"``, or a socket path (``python -m launch --peers``
    hosts the agent: lookups use it through the environment), nothing."""
    if peers != "1" or comm.size < 2:
        return None
    return start(comm, pool, origin_or_default(origin), secret, timeout=timeout,
                 environ=environ)


def origin_or_default(origin: Origin | None) -> Callable[[], Origin | None]:
    """What an owner fills from: ``origin``, else what FlashInfer's wrapper would ask
    at this miss (``DISTCACHE_ORIGIN``, ``$FLASHINFER_CUBINS_REPOSITORY``, FlashInfer's
    built-in repository), resolved when a fill needs it."""

    def resolve() -> Origin | None:
        if origin is not None:
            return origin
        from distcache.integrations.flashinfer._upstream import default_origin

        return default_origin()

    return resolve

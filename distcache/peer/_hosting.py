"""Starting the node agents of a job: once, at start-up, over distcache's communicator.

The lowest rank of each node (``Communicator.node_id``) starts an agent on the
address the job uses (:func:`job_address`) and a Unix socket in the pool directory,
on a thread (:class:`Starting`); once the caller is ready, every node's TCP endpoint
and socket are shared: handed down by the node leaders with the start-up prefetch's
report (:meth:`Starting.among_leaders`), else by one all-gather through them.
Each rank then uses its node's agent for lookups; the agents know each other and each
artifact's owner follows from the endpoints alone (:mod:`distcache.peer._ring`), so
serving needs no collective.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distcache._log import get_logger
from distcache.comm import node_layout, node_tree
from distcache.errors import WireError
from distcache.peer import _exit
from distcache.peer._auth import derive_key
from distcache.peer._reach import endpoints
from distcache.peer._tier import Tier, attach, key_path

if TYPE_CHECKING:
    from distcache.comm import Communicator
    from distcache.origins import Origin
    from distcache.peer._agent import Agent
    from distcache.store import ArtifactPool

log = get_logger(__name__)

#: The longest Unix socket path Linux takes in bytes (108 with the terminator), with room.
_MAX_SOCKET_PATH = 100
#: The longest a leader's agent waits for what it starts after (the origin's set-up).
AFTER_WAIT_S = 10.0
#: The key file each agent :func:`host_agent` started wrote (see :data:`_exit.KEY_FILES`).
_KEY_FILES = _exit.KEY_FILES


def job_address(environ: Mapping[str, str] | None = None) -> str:
    """The address this host uses for the job: the local end of the route to
    ``MASTER_ADDR`` (IPv4 or IPv6; none: a warning) when it is set, else the address the
    host name resolves to, else loopback. The agent binds this one address, never a wildcard."""
    import socket  # on the node leaders that host an agent

    master = (os.environ if environ is None else environ).get("MASTER_ADDR")
    if master:
        try:  # a UDP connect sends nothing: it picks the route and its local end
            family, *_, to = socket.getaddrinfo(master.strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(to)
                return str(s.getsockname()[0])
        except OSError as exc:  # unresolved or unroutable: the fallback may be unreachable
            log.warning("peers: MASTER_ADDR=%s: %s; binding the host name's address", master, exc)
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def socket_path(pool_root: Path, tag: str) -> Path:
    """Where a node's agent listens for the node's processes: in the pool directory
    when the path fits a Unix socket, else in a private temporary directory."""
    name = f".peer-{hashlib.sha256(tag.encode()).hexdigest()[:12]}.sock"
    path = Path(pool_root) / name
    if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:  # the kernel counts bytes
        return path
    import tempfile  # (and shutil, bz2, lzma with it) only for this fallback

    return Path(tempfile.mkdtemp(prefix="distcache-")) / name


class Hosted:
    """What :func:`start` set up on this rank: the agent it hosts (node leaders only),
    the tier its lookups use and every node agent's endpoint. :meth:`close` stops both."""

    def __init__(self, tier: Tier | None, agent: Agent | None = None,
                 nodes: list[str] | Callable[[], list[str]] | None = None) -> None:
        self.tier, self.agent = tier, agent
        self._nodes = [] if nodes is None else nodes

    @property
    def nodes(self) -> list[str]:
        """Every node agent's TCP endpoint this node reaches, in rank order."""
        if callable(self._nodes):
            self._nodes = self._nodes()
        return self._nodes

    def close(self) -> None:
        attach(None)
        if self.agent is not None:
            _exit.unregister(self.agent)
            leave(self.agent)
            self.agent = None


def leave(agent: Agent) -> None:
    """Stop ``agent`` and remove its key file and a directory made for its socket."""
    agent.stop()
    if agent.socket_path is not None:
        _remove_key(key_path(agent.socket_path), _KEY_FILES.pop(agent, None))
        _remove_made_dir(agent.socket_path, agent.pool)


def _remove_made_dir(socket: Path, pool: ArtifactPool) -> None:
    """Remove the private directory :func:`socket_path` made for ``socket`` (when the
    pool's path was too long for it), now that the socket and key are gone."""
    if socket.parent != Path(pool.root):
        with contextlib.suppress(OSError):
            socket.parent.rmdir()


def _write_key(keyfile: Path, key: bytes) -> tuple[int, int]:
    """Write ``key`` to ``keyfile``, this user's alone (0600): at a fresh name, created
    exclusively and never through a link, flushed, then renamed over ``keyfile``; so
    nothing planted at either name (a link, a file of wider mode) is written through
    or kept. The new file's (device, inode).

    Raises:
        PoolError, OSError: it cannot be written.
    """
    from distcache.store._fs import replace_from, temp_file, unlink_quietly

    temp = keyfile.with_name(f"{keyfile.name}.{os.getpid()}.{os.urandom(8).hex()}")
    fd = temp_file(str(temp))
    try:
        made = replace_from(fd, temp, keyfile, key, 0o600)
    except BaseException:
        unlink_quietly(temp)
        raise
    finally:
        os.close(fd)
    return made.st_dev, made.st_ino


def _remove_key(keyfile: Path, made: tuple[int, int] | None) -> None:
    """Remove ``keyfile`` if it is still the file :func:`_write_key` made (``made``)."""
    with contextlib.suppress(OSError):
        st = os.lstat(keyfile)
        if made is not None and (st.st_dev, st.st_ino) == made:
            os.unlink(keyfile)


def host_agent(pool: ArtifactPool, origin: Callable[[], Origin | None], key: bytes,
               tag: str, environ: Mapping[str, str] | None = None) -> Agent:
    """Start one node agent on :func:`job_address`, with its key file, then its socket
    (a process that finds the socket finds the key beside it)."""
    from distcache.peer._agent import Agent

    path = socket_path(Path(pool.root), tag)
    made = None
    try:
        made = _write_key(key_path(path), key)
        agent = Agent(pool, origin, key, host=job_address(environ), socket_path=path,
                      joining=True).start()
    except BaseException:
        _remove_key(key_path(path), made)
        _remove_made_dir(path, pool)
        raise
    _KEY_FILES[agent] = made
    _exit.register(agent, leave)  # a job that never closes its session leaves nothing
    return agent


class Starting:
    """The node agents of a job, begun by :func:`begin`: the tree, the key and, on a
    node leader, its agent starting on a thread. :meth:`finish` (collective) shares
    the endpoints and attaches this rank's tier; until then the job's collectives may
    run, the agent's start-up (importing the HTTP server, binding its sockets) going on
    beside them."""

    def __init__(self, comm: Communicator, key: bytes, timeout: float | None,
                 starter: Callable[[], Agent] | None,
                 after: threading.Thread | None = None) -> None:
        self.comm, self.key, self.timeout = comm, key, timeout
        self._agent: Agent | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._entries: list[tuple[str, str, str]] | None = None
        if starter is not None:
            self._thread = threading.Thread(target=self._run, args=(starter, after),
                                            daemon=True, name="distcache-agent-start")
            self._thread.start()

    def _run(self, starter: Callable[[], Agent], after: threading.Thread | None) -> None:
        if after is not None:  # what the prefetch waits for first (the origin's set-up)
            after.join(AFTER_WAIT_S)
        try:
            self._agent = starter()
        except BaseException as exc:  # reported by finish(), on this rank's thread
            self._error = exc

    def _started(self) -> Agent | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._agent

    def _mine(self) -> tuple[str, str, str]:
        """This rank's entry: its node, and its agent's TCP and Unix endpoints (empty
        where it hosts none, or its agent could not start)."""
        comm = self.comm
        agent = self._started()
        error, self._error = self._error, None
        if error is not None:
            # The peers still meet at the all-gather: this node goes without an agent
            # (its lookups ask the origin, as without peers), nobody waits.
            log.warning("peers: no agent on node %s: %s: %s; its lookups go to the origin",
                        comm.node_id, type(error).__name__, error)
        if agent is None:
            return (comm.node_id, "", "")
        return (comm.node_id, agent.endpoint, agent.local_endpoint or "")

    def among_leaders(self, leaders: Communicator) -> list[tuple[str, str, str]]:
        """Collective over the node leaders (one rank per node): every node's entry.
        What the leaders hand their nodes with the start-up prefetch's report
        (:func:`distcache._delegate.led_by_node_leaders`), in place of the all-gather
        of :meth:`finish`."""
        everyone = leaders.allgather_object(self._mine(), timeout=self.timeout)
        return self._checked(everyone, leaders)

    def received(self, entries: Any) -> None:
        """Take the entries the leaders handed down; :meth:`finish` then shares
        nothing more.

        Raises:
            WireError: ``entries`` is not a list of ``(node, tcp, unix)`` strings.
        """
        if _malformed(entries) is not None:
            raise WireError(f"rank {self.comm.rank}/{self.comm.size} ({self.comm.node_id}): "
                            "the node agents' endpoints from the node leader are malformed",
                            op="allgather_object", rank=self.comm.rank)
        self._entries = [(node, tcp, unix) for node, tcp, unix in entries]

    def _checked(self, entries: Any, among: Communicator) -> list[tuple[str, str, str]]:
        """``entries``, all-gathered over ``among`` (the ``i``-th from its rank ``i``),
        as tuples, once each is a node's entry as :meth:`_mine` sends it: what another
        rank sent is checked before it is unpacked or dialled. Ranks are named as
        ``among``'s (the prefetch's report turns the node leaders' into the job's).

        Raises:
            WireError: an entry is not three strings (on every rank: all got the same),
                naming the rank that sent it.
        """
        bad = _malformed(entries)
        if bad is not None:
            what = ("are not a list" if bad < 0 else f"sent by rank {bad}/{among.size} are "
                    f"malformed ({repr(entries[bad])[:80]})")
            raise WireError(f"rank {among.rank}/{among.size} ({self.comm.node_id}): the node "
                            f"agents' endpoints {what}; check that every rank runs the same "
                            "distcache", op="allgather_object", rank=among.rank,
                            peer=None if bad < 0 else bad)
        return [(node, tcp, unix) for node, tcp, unix in entries]

    def finish(self) -> Hosted:
        """Collective unless the leaders handed the entries down: every node agent's
        endpoint, shared; this rank's tier attached.

        A node whose agent cannot listen goes without one (a warning; its ranks get no
        tier), and the other nodes leave it out of their walks.

        Raises:
            CollectiveTimeout, CommError: the all-gather failed (on every rank); this
                rank's agent is stopped first. A ``WireError`` where a rank's entry is
                malformed, naming that rank.
        """
        comm = self.comm
        everyone = self._entries
        if everyone is None:
            try:
                everyone = self._checked(
                    comm.allgather_object(self._mine(), timeout=self.timeout), comm)
            except BaseException:
                self.abandon()  # nobody else holds the agent: stop it, remove its socket
                raise
        agent = self._started()
        leaders = [(node, tcp, unix) for node, tcp, unix in everyone if tcp]
        # Probing other nodes' sockets is for a ring an agent joins (and rank 0's
        # warning); another rank works its list out if it is ever asked for it.
        nodes = functools.partial(endpoints, leaders, comm.node_id, comm.rank == 0)
        if agent is not None or comm.rank == 0:
            ring = nodes()
            if agent is not None:
                agent.join(ring, ring.index(agent.endpoint))
            if comm.rank == 0:
                log.info("peers: %d node agent(s): %s", len(ring), ", ".join(ring))
            nodes = functools.partial(list, ring)
        local = next((unix or tcp for node, tcp, unix in leaders if node == comm.node_id), None)
        tier = Tier(local, self.key) if local is not None else None
        attach(tier)
        self._agent = None  # the Hosted's now
        return Hosted(tier, agent, nodes)

    def abandon(self) -> None:
        """Stop what :meth:`finish` will not be called for (a start-up that failed
        before it). Not collective."""
        agent = self._started()
        self._agent = self._error = None
        if agent is not None:
            Hosted(None, agent).close()


def _malformed(entries: Any) -> int | None:
    """Where ``entries`` is not a list of node entries as :meth:`Starting._mine` sends
    them (a tuple or list of three strings: the node, its agent's TCP and Unix
    endpoints, empty where it has none): the index of the first bad entry, -1 when
    ``entries`` is not a list at all; ``None`` when it is well formed."""
    if type(entries) is not list:
        return -1
    for i, entry in enumerate(entries):
        if not (type(entry) in (tuple, list) and len(entry) == 3
                and all(type(x) is str for x in entry)):
            return i
    return None


def begin(comm: Communicator, pool: ArtifactPool, origin: Callable[[], Origin | None],
          secret: bytes | None, *, timeout: float | None = None,
          environ: Mapping[str, str] | None = None,
          after: threading.Thread | None = None) -> Starting | None:
    """Collective: begin the node agents of this communicator's job (see
    :class:`Starting`); ``None`` (no agent, nothing to finish) when every rank is on
    one node. ``secret`` is the run scope's (``None``: rank 0 draws one, shared over
    ``comm``). A leader's agent starts once ``after`` ends (at most
    :data:`AFTER_WAIT_S` later).

    Raises:
        CollectiveTimeout, CommError: a collective failed (on every rank).
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
    starter = None
    if leader:
        tag = f"{comm.node_id}/{hashlib.sha256(key).hexdigest()[:16]}"

        def starter() -> Agent:
            return host_agent(pool, origin, key, tag, environ)

    return Starting(comm, key, timeout, starter, after)


def start(comm: Communicator, pool: ArtifactPool, origin: Callable[[], Origin | None],
          secret: bytes | None, *, timeout: float | None = None,
          environ: Mapping[str, str] | None = None) -> Hosted | None:
    """Collective: :func:`begin` then :meth:`Starting.finish`: the node agents of this
    communicator's job started and this rank's tier attached; ``None`` when every rank
    is on one node.

    Raises:
        CollectiveTimeout, CommError: an all-gather failed (on every rank).
    """
    starting = begin(comm, pool, origin, secret, timeout=timeout, environ=environ)
    return None if starting is None else starting.finish()


def start_for_session(comm: Communicator, pool: ArtifactPool, origin: Origin | None,
                      secret: bytes | None, peers: str, *, timeout: float | None = None,
                      environ: Mapping[str, str] | None = None,
                      after: threading.Thread | None = None) -> Starting | None:
    """What ``init`` begins for ``DISTCACHE_PEERS`` (:func:`begin`; the caller calls
    :meth:`Starting.finish` when it is ready to share the endpoints): ``"1"`` and more
    than one rank, the node agents; ``"0"``, or a socket path (``python -m launch
    --peers`` hosts the agent: lookups use it through the environment), nothing."""
    if peers != "1" or comm.size < 2:
        return None
    return begin(comm, pool, origin_or_default(origin), secret, timeout=timeout,
                 environ=environ, after=after)


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

"""The start-up prefetch of a node whose ranks share one pool, run by the node's leader.

The ranks of a node usually share one pool directory and pass the same manifests. Then
a member has nothing to do that its leader (the node's lowest rank) does not do for
it: the same artifacts reach the same directory. :func:`led_by_node_leaders` lets the
leaders run the prefetch on a communicator of their own and hand the outcome down
their nodes: the report, or the error that every rank raises. A member neither parses
the manifests nor plans nor enters the collective's all-gathers, so what it costs
does not grow with the job, and each step of the leaders' collective waits on one
process per node, not on every rank.

Whether the leaders may act for their nodes is decided alike on every rank, in four
small rounds, two of them within a node:

1. every rank sends the digest of its inputs (:func:`inputs_key`: the manifests' bytes,
   what its integrations want, whether it has an origin, whether it is offline) and
   its pool's id; the leader
   also sends a probe it placed in its pool (a name and content drawn for this run:
   equal pool ids are only a claim, as a pool copied to each node keeps its id);
2. each member says whether its inputs and pool id equal the leader's and it sees the
   probe, with that content, in its own pool;
3. the leaders all-gather whether every member of their node said yes;
4. each leader tells its node whether every node did.

If any rank differs anywhere, every rank takes the full collective, which reports the
difference (different manifests) or handles it (pools of their own).

Every rank also votes whether its process may use two communicators from two threads
at once (:func:`~distcache.collective._heartbeat.concurrent`: MPI below
``MPI_THREAD_MULTIPLE`` may not): a leader's node hears from it on a thread.

While its leader works, a member waits for its word: the leader's node hears from it
at least every ``min(HEARTBEAT, timeout / 4)`` seconds (a thread all-gathers on the
node's communicator while the collective runs on the leaders'), as long as the
leaders' collective makes progress (a collective completed on the leaders'
communicator: the collective's own heartbeats complete one at least every second).
A member whose leader is silent for ``timeout`` seconds, or whose leader's collective
stalled for that long, raises :class:`~distcache.errors.CollectiveTimeout`; that
leader then fails the job with the other leaders (next paragraph).

With its report a leader hands down the file identity (device, inode, size, mtime,
ctime) of each object it published, hashing it: a member's loads do not hash those
again while the files match (:meth:`ArtifactPool.vouch`): verified once per job.

The outcome is the same on every rank: after the leaders' collective, the leaders
agree on whether every node's members were still there (a node whose member left
fails the job), then each hands the report or the error down, its node hearing from
it until then: what fails on the way (that agreement, what rides along) goes down as
the collective's error would. Errors name the job's ranks (the leaders' collective
counts its own: :mod:`distcache.collective._leaders`), and after any failure every rank drops the node tree it kept (and
closes its communicators), so that the next collective makes a fresh one alike
everywhere. A member whose leader renewed their shared pool's id (a pool copied to
each node keeps its template's id until a collective tells the copies apart) reads
the new id.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from distcache._log import get_logger
from distcache.collective._heartbeat import concurrent
from distcache.collective._leaders import in_job_terms
from distcache.comm import Communicator, NodeTree
from distcache.comm._base import Forwarding, describe_error, described_error, lend_broadcast
from distcache.comm._tree import forget_tree
from distcache.config import settings
from distcache.errors import CollectiveTimeout, PoolError, WireError

if TYPE_CHECKING:
    from distcache.collective import PrefetchReport
    from distcache.store import ArtifactPool
    from distcache.store._fs import Witness

log = get_logger(__name__)

#: Longest interval between two words of a leader to its node.
HEARTBEAT = 1.0

#: What a leader says while it works.
_ALIVE = "alive"

#: The report's fields that name ranks (the leaders' own, mapped back to the job's).
_RANK_FIELDS = ("writers", "downloaders")


def led_by_node_leaders(
    tree: NodeTree, pool: ArtifactPool, key: str | None, *, timeout: float | None,
    lead: Callable[[Communicator], PrefetchReport | None], aside: Aside | None = None,
) -> tuple[PrefetchReport | None] | None:
    """Collective: when every node's ranks may leave the prefetch to their leader (see
    the module docstring), ``(report,)`` (on the leaders, what ``lead`` returned when
    called with the leaders' communicator; on the members, the same report), else
    None and nothing was prefetched. ``aside`` (alike on every rank) rides along: once
    the prefetch succeeded, the leaders call its ``among_leaders`` with their
    communicator and every rank's ``received`` gets what it returned, handed down
    with the report (no round of its own on the members).

    Raises:
        DistcacheError: what ``lead`` raised on the leaders, raised alike on each member
            (as :class:`~distcache.errors.RemoteError` where it is not one of
            distcache's own errors), in the job's ranks.
        CollectiveTimeout: a rank of the node, or a leader, did not arrive in time.
    """
    local, upper = tree.levels()
    wait = _seconds(timeout, tree)
    leader = tree.is_leader
    began = time.time_ns()  # before any object of this prefetch can be published
    with contextlib.ExitStack() as probes:
        offer = None
        if leader and key is not None:
            name, token = os.urandom(16).hex(), os.urandom(16).hex()
            if probes.enter_context(pool.identity.probe(name, token)):
                offer = (name, token)
        seen = local.allgather_object((key, pool.pool_id, offer), timeout=wait)
        able = offer is not None if leader else _shares(seen[0], key, pool)
        said = local.allgather_object(able and concurrent(tree), timeout=wait)
    if leader:
        assert upper is not None, "every leader has the leaders' communicator"
        votes = upper.allgather_object((all(s is True for s in said), tree.rank),
                                       timeout=wait)
        go = _agreed(votes, tree.leader_ranks)
        local.allgather_object(go, timeout=wait)
    else:
        go = local.allgather_object(None, timeout=wait)[0] is True
    if not go:
        log.debug("the prefetch runs on every rank: not every node's ranks share their "
                  "leader's pool and inputs")
        return None
    try:
        if leader:
            assert upper is not None
            return (_lead(tree, local, upper, pool, tree.leader_ranks, wait, lead, aside),)
        return (_follow(tree, local, pool, wait, began, aside),)
    except BaseException:
        forget_tree(tree)
        raise


class Aside(Protocol):
    """What rides along with the leaders' prefetch (see :func:`led_by_node_leaders`)."""

    def among_leaders(self, leaders: Communicator) -> Any:
        """Collective over the leaders: plain data for every rank; never raises but
        the collective's errors."""

    def received(self, data: Any) -> None:
        """Take what the leaders handed down (checked: it crossed the wire)."""


def _agreed(votes: list[Any], leaders: list[int]) -> bool:
    """Whether every node's leader voted that its node may leave the prefetch to it.

    A vote counts only as ``(bool, rank)`` whose rank is the one the tree knows that
    leader by (the collective's reports name ranks from that list, never from a vote).
    Any other vote is malformed: logged, and taken as a no. Every leader sees the same
    votes, so all decide alike and tell their members, and every rank takes the full
    collective, which checks its own payloads; no leader raises alone while its
    members wait for its word.
    """
    if len(votes) != len(leaders):  # one vote per leader, as the leaders' communicator has
        return False
    bad = [rank for vote, rank in zip(votes, leaders, strict=True)
           if not (type(vote) is tuple and len(vote) == 2 and type(vote[0]) is bool
                   and type(vote[1]) is int and vote[1] == rank)]
    if bad:
        log.warning("the node leader(s) of rank(s) %s sent a malformed vote; every rank "
                    "takes the full collective", bad)
        return False
    return all(vote[0] for vote in votes)


def _seconds(timeout: float | None, tree: NodeTree) -> float:
    if timeout is not None:
        return timeout
    given = getattr(tree, "timeout", None)
    return float(given) if isinstance(given, int | float) else settings().timeout


def _shares(offered: Any, key: str | None, pool: ArtifactPool) -> bool:
    """Whether a member's inputs and pool are its leader's, as ``offered``."""
    if not (type(offered) is tuple and len(offered) == 3):
        return False
    their_key, their_id, probe = offered
    return (key is not None and their_key == key and their_id == pool.pool_id
            and type(probe) is tuple and len(probe) == 2
            and all(type(p) is str for p in probe)
            and pool.identity.sees(probe[0], probe[1]))


class _Watched(Forwarding):
    """The leaders' communicator, with the time its last collective completed."""

    def __init__(self, base: Communicator) -> None:
        self._base = base
        self.last = time.monotonic()

    def __repr__(self) -> str:
        return f"_Watched({self._base!r})"

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        gathered = self._base.allgather_object(obj, timeout=timeout)
        self.last = time.monotonic()
        return gathered

    def broadcast_bytes(self, data: bytes | None, root: int, *,
                        timeout: float | None = None) -> bytes:
        received = self._base.broadcast_bytes(data, root, timeout=timeout)
        self.last = time.monotonic()
        return received

    def broadcast_buffer(self, data: bytearray | None, root: int, *,
                         timeout: float | None = None) -> bytes | bytearray:
        received = lend_broadcast(self._base, data, root, timeout=timeout)
        self.last = time.monotonic()
        return received

    def barrier(self, *, timeout: float | None = None) -> None:
        self._base.barrier(timeout=timeout)
        self.last = time.monotonic()

    def split(self, color: int) -> Communicator:
        return self._base.split(color)


def _lead(tree: NodeTree, local: Communicator, upper: Communicator, pool: ArtifactPool,
          leaders: list[int], wait: float,
          lead: Callable[[Communicator], PrefetchReport | None],
          aside: Aside | None = None) -> PrefetchReport | None:
    """Run the prefetch on the leaders' communicator; tell the node while it runs and
    what came of it when it ends."""
    watched = _Watched(upper)
    stop = threading.Event()
    lost: list[BaseException] = []

    def beat() -> None:
        while not stop.wait(min(HEARTBEAT, wait / 4)):
            stalled = time.monotonic() - watched.last
            if stalled > wait:
                # Its members stop waiting: this node fails the job, whatever comes.
                log.error("the node leader's prefetch made no progress for %.0f s; its "
                          "node's ranks stop waiting for it", stalled)
                lost.append(CollectiveTimeout(
                    f"the prefetch on rank {tree.rank}/{tree.size} ({tree.node_id}) made "
                    f"no progress for {stalled:.0f} s; its node's ranks stopped waiting",
                    op="allgather_object", timeout=wait, rank=tree.rank))
                return
            try:
                local.allgather_object(_ALIVE, timeout=wait)
            except BaseException as exc:  # a member gone: raised once the work ends
                lost.append(exc)
                return

    beating = threading.Thread(target=beat, daemon=True, name="distcache-node-word")
    beating.start()
    error: BaseException | None = None
    report: PrefetchReport | None = None
    word: tuple[Any, ...] = ()
    try:  # the node hears from its leader until the word, and of any failure on the way
        report = lead(watched)
        # Alike on every rank: a node whose member left fails the whole job.
        gone = [leaders[i] for i, ok in enumerate(
            watched.allgather_object(not lost, timeout=wait)) if ok is not True]
        if gone:
            error = CollectiveTimeout(
                f"the prefetch on rank {tree.rank}/{tree.size} ({tree.node_id}): the "
                f"node(s) led by rank(s) {gone} lost a rank, or stopped waiting for a "
                "leader that made no progress", op="allgather_object", timeout=wait,
                rank=tree.rank, agreed=True)
        else:
            report = _in_job_ranks(report, leaders)
            extra = None if aside is None else aside.among_leaders(upper)
            if aside is not None:
                aside.received(extra)
            word = ("report", None if report is None else report.as_dict(),
                    _witnesses(pool), extra, pool.pool_id)
    except BaseException as exc:
        error = exc
    finally:
        stop.set()
        beating.join()
    if lost:  # this node's members are not all there to hear it
        raise lost[0] if error is None else error
    if error is not None:
        error = in_job_terms(error, tree, leaders)
        word = ("error", describe_error(error), bool(getattr(error, "agreed", False)),
                pool.pool_id)
    local.allgather_object(word, timeout=wait)
    if error is not None:
        raise error
    return report


def _follow(tree: NodeTree, local: Communicator, pool: ArtifactPool,
            wait: float, began: int, aside: Aside | None = None) -> PrefetchReport | None:
    """Wait for the leader's word; the report, or the error it sends, raised."""
    where = f"rank {tree.rank}/{tree.size} ({tree.node_id})"
    while True:
        word = local.allgather_object(None, timeout=wait)[0]
        if word != _ALIVE:
            break
    if type(word) is tuple and len(word) >= 3:
        _reload_id(pool, word[-1])
    if type(word) is tuple and len(word) == 5 and word[0] == "report":
        report = _unpacked(word[1], where, tree)
        pool.vouch(_vouched(word[2], began))
        if aside is not None:
            aside.received(word[3])
        return report
    if not (type(word) is tuple and len(word) == 4 and word[0] == "error"):
        raise _malformed(where, tree)
    error = described_error(word[1], tree.leader, tree.size, tree.node_id)
    if isinstance(error, str):
        raise _malformed(where, tree)
    error.agreed = word[2] is True
    raise error


def _witnesses(pool: ArtifactPool) -> list[tuple[bytes, int, int, int, int, int]]:
    """What the leader's pool verified as it published it: each digest and its file's
    device, inode, size, mtime and ctime, for the members not to hash them again."""
    return [(bytes.fromhex(sha), *seen) for sha, seen in pool.verified().items()]


_CLOCK_GRAIN_NS = 1_000_000_000  # how much older than a member's entry (coarse file times)


def _vouched(entries: Any, began: int) -> dict[str, Witness]:
    """The leader's :func:`_witnesses` a member takes: files changed since it entered
    this prefetch (a forged word cannot point at an older one, such as one torn by a
    power loss), each trusted while it is this user's and matches. A malformed list
    is logged and ignored: it only saves hashing."""
    if not (type(entries) is list and all(
            type(e) is tuple and len(e) == 6 and type(e[0]) is bytes and len(e[0]) == 32
            and all(type(v) is int for v in e[1:]) for e in entries)):
        log.warning("the node leader's list of verified objects is malformed; this rank "
                    "hashes every object it reads")
        return {}
    return {sha.hex(): (dev, ino, size, mtime, ctime)
            for sha, dev, ino, size, mtime, ctime in entries
            if ctime >= began - _CLOCK_GRAIN_NS}


def _reload_id(pool: ArtifactPool, leaders_id: Any) -> None:
    """Read the pool's id again where the leader's collective renewed it."""
    if type(leaders_id) is str and leaders_id != pool.pool_id:
        try:
            pool.identity.reload()
        except (OSError, PoolError) as exc:
            log.warning("cannot read the renewed id of this rank's pool: %s", exc)


def _in_job_ranks(report: PrefetchReport | None, leaders: list[int]
                  ) -> PrefetchReport | None:
    """``report`` with the ranks it names (the leaders' own) as ranks of the job."""
    return None if report is None else report.replace(
        writers=tuple(leaders[r] for r in report.writers),
        downloaders=tuple(leaders[r] for r in report.downloaders))


def _unpacked(fields: Any, where: str, tree: NodeTree) -> PrefetchReport | None:
    from distcache.collective import PrefetchReport

    if fields is None:
        return None
    try:
        values = dict(fields)
        for name in _RANK_FIELDS:
            values[name] = tuple(values[name])
        left_out = values["left_out"]
        if not (type(values["operation"]) is str and type(seconds := values["seconds"]) is dict
                and all(type(v) is int for n in PrefetchReport._FIELDS
                        if n not in ("operation", "seconds", "left_out")
                        for v in (values[n] if n in _RANK_FIELDS else (values[n],)))
                and all(type(k) is str and type(v) in (int, float) for k, v in seconds.items())
                and type(left_out) is tuple and all(type(n) is str for n in left_out)):
            raise ValueError("a field of the report has the wrong type")
        return PrefetchReport(**values)
    except (TypeError, ValueError, KeyError) as exc:
        raise _malformed(where, tree) from exc


def _malformed(where: str, tree: NodeTree) -> WireError:
    return WireError(f"the prefetch on {where}: the node leader's word is malformed",
                     op="allgather_object", rank=tree.rank, backend=tree.backend,
                     peer=tree.leader)

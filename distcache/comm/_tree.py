"""Node-leader aggregation: all-gathers whose cost per rank follows the nodes, not the ranks.

A flat all-gather hands every rank every other rank's payload, so what one rank receives
grows with the job. The collective's payloads are mostly alike within a node (the pool's
id, its have-bitmap, the agreed list's digest, "no failure"), so :class:`NodeTree`
routes :meth:`~NodeTree.allgather_object` through one leader per node:

1. the ranks of a node all-gather their encoded payloads on the node's communicator, and
   its leader (the node's lowest rank) keeps each distinct payload once, with one index
   per member;
2. the leaders all-gather those node blocks among themselves;
3. each leader folds the blocks into one table of distinct payloads and a run-length
   list of indices in rank order, and hands that down its node (an all-gather on the
   node's communicator in which only the leader sends: the broadcasts of a communicator
   stay the collective's buckets).

Every rank then decodes each rank's entry from the table, so the result is the list a
flat all-gather returns, element for element (each entry decoded on its own: a caller
may change one without changing another). What a rank receives is its node's payloads
plus the distinct payloads of the job and one run per change of payload in rank order:
for the collective's payloads, a fixed amount per node.

The tree is made once per communicator (:func:`node_tree` keeps it): one all-gather of
the node ids and two splits. Broadcasts, barriers and splits go to the wrapped
communicator unchanged. A job with one rank per node, or one node, uses the wrapped
communicator directly: there is nothing to aggregate; so do in-process ranks
(:data:`IN_PROCESS`), unless a :class:`NodeTree` is made explicitly.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from itertools import groupby
from typing import Any

from distcache.comm._base import Communicator, Wrapping, check_timeout
from distcache.comm._codec import decode_each, decode_from, encode
from distcache.errors import WireError

#: Backends whose ranks share one process: a payload "sent" is a reference handed
#: over, so there is nothing per rank to save and the tree would only add two steps.
IN_PROCESS = ("local", "threads")

_trees: weakref.WeakKeyDictionary[Any, NodeTree] = weakref.WeakKeyDictionary()


def node_tree(comm: Communicator, *, timeout: float | None = None) -> Communicator:
    """Collective: ``comm`` with its all-gathers routed through node leaders, made once
    per communicator and kept for as long as ``comm`` lives (a communicator that
    cannot be kept returns a fresh tree each time). A job with one rank per node or
    a single node, and in-process ranks (:data:`IN_PROCESS`), get ``comm`` itself.

    Raises:
        CollectiveTimeout: not every rank arrived in time.
    """
    if isinstance(comm, NodeTree) or comm.size == 1 or comm.backend in IN_PROCESS:
        return comm
    return _kept(comm, timeout).selected()


def _kept(comm: Communicator, timeout: float | None) -> NodeTree:
    """Collective unless kept: ``comm``'s tree, made (and kept, where ``comm`` can be
    weakly referred to) when there is none or its split-off communicators were let go."""
    try:
        kept = _trees.get(comm)
    except TypeError:  # not weakly referable: nothing to keep it on
        kept = None
    if kept is not None and not kept.stale():
        return kept
    tree = NodeTree(comm, timeout=timeout)
    with contextlib.suppress(TypeError):
        _trees[comm] = tree
    return tree


def forget_tree(tree: NodeTree) -> None:
    """Let go of ``tree`` where :func:`node_tree` keeps it, and of the communicators it
    made (:meth:`NodeTree.release`): the next call makes a fresh one. Call it alike on
    every rank (after a failure every rank raises): the ranks stay in step."""
    with contextlib.suppress(TypeError):
        if _trees.get(tree.base) is tree:
            del _trees[tree.base]
    tree.release()


def _unwrapped(comm: Any) -> list[Any]:
    """``comm`` and each communicator it wraps, outermost first."""
    return [comm, *_unwrapped(comm.base)] if isinstance(comm, Wrapping) else [comm]


def node_layout(comm: Communicator, *, timeout: float | None = None) -> tuple[int, bool]:
    """Collective the first time: how many nodes ``comm``'s ranks are on, and whether
    this rank is the lowest of its node. Read from the tree :func:`node_tree` keeps
    (made here when there is none yet), so a caller that uses the tree anyway pays no
    collective for it.

    Raises:
        CollectiveTimeout: not every rank arrived in time.
    """
    if isinstance(comm, NodeTree):
        return comm.nodes, comm.is_leader
    if comm.size == 1:
        return 1, True
    if comm.backend in IN_PROCESS:
        nodes: list[str] = comm.allgather_object(comm.node_id, timeout=timeout)
        return len(set(nodes)), nodes.index(comm.node_id) == comm.rank
    tree = _kept(comm, timeout)
    return tree.nodes, tree.is_leader


def reduce_object(comm: Communicator, obj: Any, combine: Callable[[list[Any]], Any], *,
                  timeout: float | None = None) -> Any:
    """Collective: ``combine`` of every rank's ``obj``, the same value on every rank.

    On a :class:`NodeTree` each node's leader combines its node's values and every rank
    combines the leaders' results, so what a rank receives is its node's values and one
    value per node; elsewhere ``combine`` runs over a plain all-gather. So ``combine``
    must give the same result either way (``combine`` of partial results equals
    ``combine`` of the whole list, as sums, maxima and unions do) and return plain data.

    Raises:
        CollectiveTimeout: not every rank arrived in time.
        WireError: ``obj`` or a combined value is not plain data.
    """
    if isinstance(comm, NodeTree):
        return comm.allreduce_object(obj, combine, timeout=timeout)
    return combine(comm.allgather_object(obj, timeout=timeout))


def _runs(indices: list[int]) -> list[int]:
    """``[count, index, count, index, ...]`` for consecutive equal ``indices``."""
    return [n for index, run in groupby(indices) for n in (len(list(run)), index)]


def _combined(combine: Callable[[list[Any]], Any], values: list[Any]) -> tuple[bool, Any]:
    """``(True, combine(values))``, or ``(False, why)`` where it raised or its result
    is not plain data."""
    try:
        value = combine(values)
        encode(value)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, value


class NodeTree(Wrapping):
    """A :class:`~distcache.comm._base.Communicator` over ``base`` whose all-gathers
    go through node leaders (see the module docstring). Collective to make."""

    def __init__(self, base: Communicator, *, timeout: float | None = None) -> None:
        self._base = base
        # Where the communicator's making already carried every rank's node (MPI's
        # arrival check), no all-gather of its own.
        known = getattr(base, "node_keys", None)
        nodes: list[Any] | None = known() if known is not None else None
        gathered = nodes is None or len(nodes) != base.size
        if gathered:
            nodes = base.allgather_object(base.node_id, timeout=timeout)
        assert nodes is not None
        index: dict[Any, int] = {}
        self._members: list[list[int]] = []
        for rank, node in enumerate(nodes):
            if type(node) not in (str, bytes):
                raise WireError(
                    f"NodeTree on rank {base.rank}/{base.size}: rank {rank} sent a node id "
                    f"that is not a string ({type(node).__name__})",
                    op="allgather_object", rank=base.rank, backend=base.backend, peer=rank)
            k = index.setdefault(node, len(index))
            if k == len(self._members):
                self._members.append([])
            self._members[k].append(rank)
        self._node = index[nodes[base.rank]]
        self._flat = len(self._members) in (1, base.size)
        self._local: Communicator | None = None
        self._upper: Communicator | None = None
        self._owns = any(getattr(base, n, None) for n in ("group_owned", "split_owned"))
        if not self._flat:
            # Communicators of the tree's own: the collective splits the same ranks off
            # (a node's leaders are often its pools' writers) and moves buckets on them
            # on a thread while this tree carries the heartbeats. Where the backend can
            # make a communicator among some ranks alone (MPI), each node makes its
            # own and only the leaders make theirs: a member takes part in one
            # creation among its node's ranks, not two among the job's. Making a
            # group has no timeout, so every rank must be known to be here first: the
            # all-gather above proves it; node ids carried by MPI's arrival check
            # prove only that every rank was there when the communicator was made,
            # so a timed barrier does (a rank that failed since would otherwise
            # leave its node's other ranks blocked in the creation).
            group = getattr(base, "group_owned", None)
            if group is not None:
                if not gathered:
                    base.barrier(timeout=timeout)
                self._local = group(self._members[self._node])
                if self.is_leader:
                    self._upper = group([members[0] for members in self._members])
            else:
                split = getattr(base, "split_owned", None) or base.split
                self._local = split(self._node)
                self._upper = split(0 if self.is_leader else 1)

    def selected(self) -> Communicator:
        """This tree, or the wrapped communicator where the tree would add nothing."""
        return self._base if self._flat else self

    def stale(self) -> bool:
        """Whether a communicator this tree split off was let go (the wrapped one
        keeps a bounded number of children and closes the oldest, on every rank
        alike): the tree must be made again."""
        return any(getattr(c, "usable", True) is False
                   for c in (self._local, self._upper) if c is not None)

    def release(self) -> None:
        """Close the communicators this tree made of its own (not plain ``split``'s:
        handed out again) and drop them from those the wrapped one closes with itself;
        later collectives on the tree raise. Local; idempotent."""
        made = [c for c in (self._local, self._upper) if c is not None and self._owns]
        ours = {id(c) for m in made for c in _unwrapped(m)}
        for owner in _unwrapped(self._base):
            kept = getattr(owner, "_owned_children", [])
            for child in [c for c in kept if id(c) in ours]:
                kept.remove(child)
        for comm in made:
            getattr(comm, "close", lambda: None)()

    # -- identity: the wrapped communicator's (Wrapping), and the nodes ------------------

    @property
    def nodes(self) -> int:
        """How many nodes the job's ranks are on."""
        return len(self._members)

    @property
    def is_leader(self) -> bool:
        return self.leader == self._base.rank

    @property
    def node_index(self) -> int:
        """This rank's node's place among the nodes, in the order of their lowest
        ranks: on a leader, its rank among the leaders."""
        return self._node

    def __getattr__(self, name: str) -> Any:
        # Options of the wrapped communicator (timeout, chunk_bytes, broadcast_buffer).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._base, name)

    def __repr__(self) -> str:
        return f"NodeTree({self._base!r}, nodes={len(self._members)})"

    # -- collectives ------------------------------------------------------------------

    def broadcast_bytes(self, data: bytes | None, root: int, *,
                        timeout: float | None = None) -> bytes:
        return self._base.broadcast_bytes(data, root, timeout=timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._base.barrier(timeout=timeout)

    def split(self, color: int) -> Communicator:
        return self._base.split(color)

    def _clock(self, timeout: float | None) -> Callable[[], float | None]:
        check_timeout(timeout)
        wait = timeout if timeout is not None else getattr(self._base, "timeout", None)
        until = None if wait is None else time.monotonic() + wait

        def left() -> float | None:
            return None if until is None else max(0.001, until - time.monotonic())

        return left

    def node_of(self, rank: int) -> list[int]:
        """The ranks (of the wrapped communicator) on ``rank``'s node."""
        return next(list(m) for m in self._members if rank in m)

    @property
    def leader(self) -> int:
        """The rank (of the wrapped communicator) that leads this rank's node."""
        return self._members[self._node][0]

    @property
    def leader_ranks(self) -> list[int]:
        """The rank leading each node, in node order (the leaders' communicator's)."""
        return [members[0] for members in self._members]

    def levels(self) -> tuple[Communicator, Communicator | None]:
        """The node's communicator (its leader is rank 0 there) and the leaders' (on a
        member: the other members', or None where the backend made the leaders' among
        the leaders alone), both made off the wrapped one."""
        local = self._local
        assert local is not None, "a flat tree is never handed out"
        return local, self._upper

    def _leaders(self, upper: Communicator | None) -> Communicator:
        assert upper is not None, "every leader has the leaders' communicator"
        return upper

    def allreduce_object(self, obj: Any, combine: Callable[[list[Any]], Any], *,
                         timeout: float | None = None) -> Any:
        """:func:`reduce_object` through the node leaders."""
        encode(obj)  # refused here, before this rank enters the collective
        left = self._clock(timeout)
        local, upper = self.levels()
        values = local.allgather_object(obj, timeout=left())
        if self.is_leader:
            # A combination that fails travels on as its reason, so that every rank
            # raises alike instead of the others waiting out their timeout.
            per_node = self._leaders(upper).allgather_object(_combined(combine, values),
                                                             timeout=left())
            failed = next((p for p in per_node if not (type(p) is tuple and len(p) == 2
                                                       and p[0] is True)), None)
            answer = self._down(local, encode(failed if failed is not None else _combined(
                combine, [p[1] for p in per_node])), left())
        else:
            answer = self._down(local, None, left())
        base = self._base
        where = f"rank {base.rank}/{base.size} ({base.node_id})"
        result = decode_from(answer, self.leader, where, rank=base.rank, backend=base.backend)
        if not (type(result) is tuple and len(result) == 2 and result[0] is True):
            why = result[1] if type(result) is tuple and len(result) == 2 else "malformed"
            raise WireError(f"allreduce_object on {where}: the reduction failed: {why}",
                            op="allreduce_object", rank=base.rank, backend=base.backend,
                            peer=self.leader)
        return result[1]

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        mine = encode(obj)  # refused here, before this rank enters the collective
        left = self._clock(timeout)
        local, upper = self.levels()
        parts = local.allgather_object(mine, timeout=left())
        if self.is_leader:
            # A member's part that is not bytes goes up as its rank: every rank fails alike.
            bad = [i for i, p in enumerate(parts) if type(p) is not bytes]
            distinct: dict[bytes, int] = {}
            indices = [distinct.setdefault(p, len(distinct)) for p in parts if not bad]
            block = self._members[self._node][bad[0]] if bad else (list(distinct), indices)
            blocks = self._leaders(upper).allgather_object(block, timeout=left())
            answer = self._down(local, encode(self._fold(blocks)), left())
        else:
            answer = self._down(local, None, left())
        return self._unfold(answer)

    def _down(self, local: Communicator, answer: bytes | None,
              timeout: float | None) -> bytes:
        """The leader's ``answer`` on every rank of the node. An all-gather in which the
        other members send nothing: the node's broadcasts stay the collective's own
        (buckets of artifacts), and a member that is gone still fails it in time."""
        gathered = local.allgather_object(answer, timeout=timeout)
        if type(gathered[0]) is not bytes:
            base = self._base
            raise WireError(
                f"allgather_object on rank {base.rank}/{base.size}: the node leader sent "
                "no answer", op="allgather_object", rank=base.rank, backend=base.backend,
                peer=self._members[self._node][0])
        return gathered[0]

    def _fold(self, blocks: list[Any]) -> tuple[list[bytes], list[int]] | str:
        """The leaders' blocks as one table and its runs, or what is wrong with one."""
        table: dict[bytes, int] = {}
        per_rank = [0] * self._base.size
        for k, block in enumerate(blocks):
            members = self._members[k]
            if type(block) is int and block in members:  # its leader's word: not bytes
                return f"rank {block} sent a part that is not an encoded payload"
            if not (type(block) is tuple and len(block) == 2 and type(block[0]) is list
                    and type(block[1]) is list and len(block[1]) == len(members)
                    and all(type(p) is bytes for p in block[0])
                    and all(type(i) is int and 0 <= i < len(block[0]) for i in block[1])):
                return f"the node block of rank {members[0]} is malformed"
            ids = [table.setdefault(p, len(table)) for p in block[0]]
            for rank, i in zip(members, block[1], strict=True):
                per_rank[rank] = ids[i]
        return list(table), _runs(per_rank)

    def _unfold(self, answer: bytes) -> list[Any]:
        base = self._base
        where = f"rank {base.rank}/{base.size} ({base.node_id})"
        leader = self._members[self._node][0]
        folded = decode_from(answer, leader, where, rank=base.rank, backend=base.backend)
        if type(folded) is str:
            raise WireError(f"allgather_object on {where}: {folded}", op="allgather_object",
                            rank=base.rank, backend=base.backend, peer=leader)
        table, runs = folded if type(folded) is tuple and len(folded) == 2 else (None, None)
        # Checked whole before any run is expanded: a forged count must not allocate.
        if not (type(table) is list and all(type(p) is bytes for p in table)
                and type(runs) is list and len(runs) % 2 == 0
                and all(type(c) is int and c > 0 for c in runs[::2])
                and all(type(i) is int and 0 <= i < len(table) for i in runs[1::2])
                and sum(runs[::2]) == base.size):
            raise WireError(f"allgather_object on {where}: the node leader's answer is "
                            f"malformed or does not cover the {base.size} ranks",
                            op="allgather_object", rank=base.rank, backend=base.backend,
                            peer=leader)
        return decode_each(((index, table[index])
                            for count, index in zip(runs[::2], runs[1::2], strict=True)
                            for _ in range(count)), where, rank=base.rank, backend=base.backend)

"""Audiences: which writers take part in moving which objects.

An object's *audience* is its source writer plus the writers of the pools that lack
it. Bytes travel only within an audience, so a pool that already holds an object never
receives it: the common repair cases (one node replaced with an empty pool among warm
ones, a ``sync`` after one rank warmed up lazily) send each byte to the pools that need
it and to no other.

At a cold start every pool lacks every object, so the one audience is every writer and
the bytes go over the writers' communicator as they always did. A smaller audience gets
a communicator of exactly its ranks, split off the writers' communicator:

* Every writer calls every split, in the plan's order, before any bytes move. The plan
  is a pure function of all-gathered data, so the splits (and the streams after them)
  are the same on every writer: deadlock-free by construction. Splitting first also
  means no writer waits in a split while an audience it is not part of is streaming.
* Writers then stream their audiences in plan order. Audiences whose ranks do not
  overlap stream at the same time; where they overlap, the common order rules out a
  cycle of waits. A writer whose audience waits for a member still busy in an earlier
  audience (one this writer is not part of) waits for its turn (:class:`Turns`) as long
  as the job's heartbeats say the members it waits for are there, not a fixed timeout.
* A split's colors name its *partition* canonically (each side is colored by its
  lowest rank), so the same split of the writers yields the same colors in every call,
  whichever side is the audience. The MPI and torch communicators keep one child per
  partition, so repeated prefetches and syncs reuse their communicators, and torch
  never builds a process group of the same ranks twice.
* At most :data:`MAX_AUDIENCES` smaller audiences per call (the ones that save the most
  bytes); the objects of any others go to every writer, and a writer whose pool already
  holds one discards it, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from distcache.comm import Communicator
from distcache.errors import CollectiveTimeout

#: Most audiences smaller than "every writer" that one collective splits off.
MAX_AUDIENCES = 8

#: ``(source writer rank, object indices)``: one source's stream, in send order.
Send = tuple[int, tuple[int, ...]]


class Audience(NamedTuple):
    """Writers that take part in some streams, and those streams."""

    #: World ranks of the writers taking part, sorted; every source is one of them.
    ranks: tuple[int, ...]
    #: The streams, in order; each reaches every other rank of the audience.
    sends: tuple[Send, ...]

    @property
    def objects(self) -> int:
        return sum(len(indices) for _, indices in self.sends)


def group_by_audience(
    source_of: Mapping[int, int],
    lacking: Sequence[frozenset[str]],
    writers: Mapping[str, int],
    pool_of: Mapping[int, str],
    weights: Sequence[int],
    *,
    max_audiences: int = MAX_AUDIENCES,
) -> tuple[Audience, ...]:
    """Group each object's send by its audience.

    Args:
        source_of: object index -> source writer rank (objects to move only).
        lacking: per object, the pools that lack it at planning time.
        writers: pool id -> writer rank.
        pool_of: writer rank -> its pool id.
        weights: per object, its size (or 1 when unknown): what not sending it saves.
        max_audiences: cap on audiences smaller than every writer.

    Returns:
        The every-writer audience first (when it has sends), then the smaller ones
        sorted by ranks. Objects whose only receivers are nobody are dropped.
    """
    everyone = tuple(sorted(writers.values()))
    grouped: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for i in sorted(source_of):
        source = source_of[i]
        receivers = lacking[i] - {pool_of[source]}
        if not receivers:
            continue
        ranks = tuple(sorted({source, *(writers[p] for p in receivers)}))
        grouped.setdefault(ranks, {}).setdefault(source, []).append(i)

    def saving(ranks: tuple[int, ...]) -> int:
        moved = sum(weights[i] for indices in grouped[ranks].values() for i in indices)
        return moved * (len(everyone) - len(ranks))

    smaller = sorted((r for r in grouped if r != everyone), key=lambda r: (-saving(r), r))
    kept = sorted(smaller[: max(0, max_audiences)])
    broad: dict[int, list[int]] = {}
    for ranks in [everyone, *smaller[len(kept) :]]:
        for source, indices in grouped.get(ranks, {}).items():
            broad.setdefault(source, []).extend(indices)

    def sends(per_source: Mapping[int, list[int]]) -> tuple[Send, ...]:
        return tuple((s, tuple(sorted(per_source[s]))) for s in sorted(per_source))

    audiences = [Audience(everyone, sends(broad))] if broad else []
    audiences.extend(Audience(ranks, sends(grouped[ranks])) for ranks in kept)
    return tuple(audiences)


def split_audiences(
    wcomm: Communicator, world_rank: int, writers: Sequence[int], audiences: Sequence[Audience]
) -> list[Communicator | None]:
    """Collective over the writers' communicator: one communicator per audience.

    Returns, per audience, the communicator to stream it on when ``world_rank`` is one
    of its ranks, else None. The every-writer audience uses ``wcomm`` itself; each
    smaller one costs one split (see the module docstring for the colors).
    """
    everyone = tuple(sorted(writers))
    comms: list[Communicator | None] = []
    for audience in audiences:
        member = world_rank in audience.ranks
        if audience.ranks == everyone:
            comms.append(wcomm if member else None)
            continue
        rest = [w for w in everyone if w not in audience.ranks]
        child = wcomm.split(audience.ranks[0] if member else rest[0])
        comms.append(child if member else None)
    return comms


class Turns:
    """When one rank may enter each of its audiences, told by the job's heartbeats.

    Each beat carries :meth:`ready` from every rank, combined with a bitwise and, and
    hands the result to :meth:`heard`: bit ``k`` is set once every member of audience
    ``k`` has reached it (finished the audiences before it). A rank enters an audience
    at once unless a fellow member is part of an earlier audience that this rank is
    not (then that member may be busy for a long time, streaming); such a rank waits
    in :meth:`enter` until the beat says every member is there. The lowest audience
    not yet over always has every member there, so the waits end while the move makes
    progress; a member that stalls, or is gone, fails the heartbeats themselves, which
    then :meth:`abandon` the waits. ``waits=False`` (no heartbeats beside the move)
    never waits.
    """

    #: Longest slice of a wait for a turn between two looks (and progress notes).
    SLICE = 0.1

    def __init__(self, rank: int, audiences: Sequence[Audience], *, waits: bool = True) -> None:
        self._rank = rank
        self._member = [rank in a.ranks for a in audiences]
        self._waits = [waits and any(
            member != rank and member in earlier.ranks and rank not in earlier.ranks
            for earlier in audiences[:k] for member in audience.ranks)
            for k, audience in enumerate(audiences)]
        self._reached = 0  # the audience this rank is at (their count once over)
        self._heard = 0
        self._abandoned = False
        self._cond = threading.Condition()

    def ready(self) -> int:
        """This rank's part of a beat: the audiences that need not wait for it."""
        with self._cond:
            return sum(1 << k for k, member in enumerate(self._member)
                       if not member or k <= self._reached)

    def heard(self, ready: int) -> None:
        """A beat's combined :meth:`ready`."""
        with self._cond:
            self._heard |= ready
            self._cond.notify_all()

    def abandon(self) -> None:
        """The heartbeats failed: a wait for a turn ends (and raises)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def leave(self) -> None:
        """This rank's move is over: no audience waits for it."""
        with self._cond:
            self._reached = len(self._member)

    def enter(self, index: int, timeout: float | None,
              on_wait: Callable[[], None] | None = None) -> None:
        """Collective in effect: this rank reached audience ``index``; return once its
        members are all there, calling ``on_wait`` after each slice of the wait.

        Raises:
            CollectiveTimeout: the heartbeats gave up while this rank waited.
        """
        pause = self.SLICE if timeout is None else min(self.SLICE, timeout / 8)
        with self._cond:
            self._reached = index
            while self._waits[index] and not self._heard >> index & 1:
                if self._abandoned:
                    raise CollectiveTimeout(
                        f"rank {self._rank}: the collective gave up while this rank waited "
                        f"for the members of audience {index} to finish earlier ones",
                        op="move", rank=self._rank, timeout=timeout)
                self._cond.wait(pause)
                if on_wait is not None:
                    on_wait()

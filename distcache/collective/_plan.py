"""Planning the collective: who downloads what, who sends what, who publishes.

Everything here is a pure function of what the ranks all-gathered, so every rank
computes the same plan without another message; that is what makes the collective
deadlock-free by construction (every rank knows every broadcast that will happen).

Decisions the plan encodes:

* **One writer per pool.** Ranks with the same pool label share a directory; the
  lowest such rank is the pool's writer. Only writers take part in moving bytes, and
  each pool receives each artifact exactly once. The labels are the pools' ids as
  :func:`~distcache.collective._sharing.agree_pools` proved them, never the ids as
  reported: a copied pool reports its template's id.
* **Any rank may download.** Publication into a pool is atomic (temp file + rename),
  so a non-writer can publish a download straight into its own pool. Downloads are
  therefore spread over *all* ranks, interleaved across nodes, largest first onto the
  least-loaded rank. With one shared pool this puts every rank to work and nothing
  moves over the communicator at all.
* **Sources are writers, reading from their pool as the downloads land.** An artifact
  downloaded by rank r is sent by the writer of r's pool, which reads it back from the
  pool as soon as it is published when r is the writer itself (the move runs beside
  the fetch), else once every download has finished. The downloader never holds the
  bytes for the move, which keeps memory bounded by a bucket, not by the list.
* **One source per lack-set.** Objects that some pools already hold are sent by a
  holder; all objects lacked by the same set of pools share one source (the least
  loaded holder, lowest rank first), so they form one audience
  (:mod:`distcache.collective._audience`) and cost at most one split, while distinct lack-sets
  spread over holders and can stream side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from distcache.collective._audience import MAX_AUDIENCES, Audience, Send, group_by_audience


def encode_bitmap(flags: Sequence[bool]) -> bytes:
    """Pack ``flags`` into ``ceil(len/8)`` bytes, bit ``i % 8`` of byte ``i // 8``."""
    out = bytearray((len(flags) + 7) // 8)
    for i, flag in enumerate(flags):
        if flag:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def decode_bitmap(data: bytes, count: int) -> list[bool]:
    """Inverse of :func:`encode_bitmap`.

    Raises:
        ValueError: ``data`` has the wrong length for ``count`` flags.
    """
    if len(data) != (count + 7) // 8:
        raise ValueError(f"bitmap of {len(data)} bytes cannot hold exactly {count} flags")
    return [bool(data[i >> 3] & (1 << (i & 7))) for i in range(count)]


def elect_writers(pool_ids: Sequence[str]) -> dict[str, int]:
    """``pool label -> lowest rank`` that holds it (``pool_ids`` is indexed by rank, and
    holds the labels :func:`~distcache.collective._sharing.agree_pools` returned)."""
    writers: dict[str, int] = {}
    for rank, pool_id in enumerate(pool_ids):
        writers.setdefault(pool_id, rank)
    return writers


def node_interleaved(node_ids: Sequence[str]) -> list[int]:
    """Ranks ordered so that consecutive entries sit on different nodes.

    ``[a, a, b, b]`` gives ``[0, 2, 1, 3]``: handing downloads out in this order uses
    every node's network link before doubling up on any.
    """
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    columns = list(by_node.values())
    order: list[int] = []
    for depth in range(max((len(c) for c in columns), default=0)):
        order.extend(c[depth] for c in columns if depth < len(c))
    return order


class Plan(NamedTuple):
    """Who does what. Indices refer to the agreed, sorted list of objects (shas)."""

    #: The objects (sha256) in agreed order.
    objects: tuple[str, ...]
    #: Distinct pool ids, in order of their writers' ranks.
    pools: tuple[str, ...]
    #: ``pool_id -> writer rank``.
    writers: Mapping[str, int]
    #: Per object: the pools that lack it at planning time.
    lacking: tuple[frozenset[str], ...]
    #: ``rank -> object indices`` it downloads from the origin (ranks with none omitted).
    downloads: Mapping[int, tuple[int, ...]]
    #: Who moves what to whom, in order: the every-writer audience first (when it has
    #: sends), then smaller ones (see :mod:`distcache.collective._audience`).
    audiences: tuple[Audience, ...]
    #: Objects that no pool has and no rank may download (sync only).
    lost: tuple[int, ...]

    @property
    def sends(self) -> tuple[Send, ...]:
        """Every ``(source writer rank, object indices)`` stream, in audience order."""
        return tuple(send for audience in self.audiences for send in audience.sends)

    @property
    def writer_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.writers.values()))

    @property
    def hits(self) -> int:
        """Objects every pool already had: no download, no movement."""
        return sum(1 for missing in self.lacking if not missing)

    @property
    def download_count(self) -> int:
        return sum(len(v) for v in self.downloads.values())

    def downloader_of(self, index: int) -> int | None:
        for rank, indices in self.downloads.items():
            if index in indices:
                return rank
        return None

    def publications(self) -> int:
        """``(pool, object)`` pairs that the plan fills, i.e. objects published."""
        return sum(len(missing) for i, missing in enumerate(self.lacking) if i not in self.lost)


def max_downloaders(per_rank: int, per_job: int) -> int:
    """Most ranks that download in one plan: the job's ``per_job`` connections carried
    at ``per_rank`` each, on as few ranks as hold them."""
    return -(-per_job // per_rank)


def download_threads(plan: Plan, rank: int, per_rank: int, per_job: int) -> int:
    """Threads ``rank`` downloads with: ``per_rank``, unless the job's ``per_job``
    connections shared over the plan's downloaders (the first ones get the remainder)
    give it fewer; at least 1 for a downloader."""
    ranks = sorted(plan.downloads)
    if rank not in plan.downloads:
        return 0
    share, extra = divmod(per_job, len(ranks))
    return max(1, min(per_rank, share + (1 if ranks.index(rank) < extra else 0)))


def make_plan(
    objects: Sequence[str],
    sizes: Sequence[int | None],
    pool_ids: Sequence[str],
    node_ids: Sequence[str],
    have: Mapping[str, Sequence[bool]],
    *,
    allow_downloads: bool = True,
    max_audiences: int = MAX_AUDIENCES,
    max_downloaders: int | None = None,
) -> Plan:
    """Plan one collective.

    Args:
        objects: shas in agreed order.
        sizes: per object, its size when known (used to balance downloads).
        pool_ids: per rank, the label of the pool it uses (proved shared, see
            :func:`~distcache.collective._sharing.agree_pools`).
        node_ids: per rank, the node it runs on.
        have: per pool id, per object, whether the pool holds it.
        allow_downloads: False for ``sync``: objects no pool holds are reported in
            ``lost`` instead of being assigned a downloader.
        max_audiences: most audiences smaller than every writer (see
            :func:`distcache.collective._audience.group_by_audience`).
        max_downloaders: most ranks that download (the first ones in node-interleaved
            order, so the downloads still spread over nodes); ``None``: every rank.

    Raises:
        ValueError: inconsistent lengths or a pool without a have-set.
    """
    count = len(objects)
    if len(sizes) != count:
        raise ValueError(f"{len(sizes)} sizes for {count} objects")
    if len(node_ids) != len(pool_ids):
        raise ValueError(f"{len(node_ids)} node ids for {len(pool_ids)} ranks")
    writers = elect_writers(pool_ids)
    pools = tuple(sorted(writers, key=writers.__getitem__))
    for pool_id in pools:
        flags = have.get(pool_id)
        if flags is None or len(flags) != count:
            raise ValueError(f"pool {pool_id!r} has no have-set of {count} flags")

    lacking = tuple(frozenset(p for p in pools if not have[p][i]) for i in range(count))
    missing_everywhere = [i for i in range(count) if len(lacking[i]) == len(pools)]

    # Largest first onto the least-loaded rank; ties go to the next rank in node-
    # interleaved order, so equal (or unknown) sizes are dealt round-robin over nodes.
    downloads: dict[int, list[int]] = {}
    lost: list[int] = []
    if allow_downloads:
        order = node_interleaved(node_ids)
        if max_downloaders is not None:
            order = order[: max(1, max_downloaders)]
        position = {rank: pos for pos, rank in enumerate(order)}
        load = {rank: (0, 0) for rank in order}
        for i in sorted(missing_everywhere, key=lambda i: (-(sizes[i] or 0), i)):
            rank = min(order, key=lambda r: (*load[r], position[r]))
            nbytes, n = load[rank]
            load[rank] = (nbytes + (sizes[i] or 0), n + 1)
            downloads.setdefault(rank, []).append(i)
    else:
        lost = missing_everywhere

    # After the fetch phase the downloader's pool holds the object; its writer sends
    # it (to every writer: no pool had it). Load is (bytes, objects) to send.
    weights = [size if size is not None else 1 for size in sizes]
    source_of: dict[int, int] = {}
    sending = {w: (0, 0) for w in writers.values()}
    for rank, indices in sorted(downloads.items()):
        for i in indices:
            source = source_of[i] = writers[pool_ids[rank]]
            sending[source] = (sending[source][0] + weights[i], sending[source][1] + 1)
    # Objects some pool already had: one source per lack-set (every holder of one such
    # object holds them all), biggest set first onto the least-loaded holder.
    lost_set = set(lost)
    by_lack: dict[frozenset[str], list[int]] = {}
    for i in range(count):
        if i not in source_of and i not in lost_set and lacking[i]:
            by_lack.setdefault(lacking[i], []).append(i)
    ordered = sorted(
        by_lack.items(), key=lambda kv: (-sum(weights[i] for i in kv[1]), sorted(kv[0]))
    )
    for lack, indices in ordered:
        holders = [writers[p] for p in pools if p not in lack]
        source = min(holders, key=lambda w: (*sending[w], w))
        for i in indices:
            source_of[i] = source
        sending[source] = (
            sending[source][0] + sum(weights[i] for i in indices),
            sending[source][1] + len(indices),
        )

    audiences = group_by_audience(
        source_of,
        lacking,
        writers,
        {w: p for p, w in writers.items()},
        weights,
        max_audiences=max_audiences,
    )

    return Plan(
        objects=tuple(objects),
        pools=pools,
        writers=dict(writers),
        lacking=lacking,
        downloads={r: tuple(sorted(v)) for r, v in sorted(downloads.items())},
        audiences=audiences,
        lost=tuple(lost),
    )

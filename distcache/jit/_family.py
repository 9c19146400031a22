"""A directory family as an :class:`~distcache.integrations.Integration`: what its
pool holds is prefetched at ``init`` (its :meth:`Family.manifest`), its directories are
filled at install, and :meth:`Family.publish` stores what this rank built.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.errors import JitCacheError, PoolError
from distcache.jit._place import (
    Fresh,
    Placed,
    Seen,
    materialize_entries,
    scan_into,
    settle,
)
from distcache.jit._tree import (
    ConflictLog,
    TreeEntry,
    TreeManifest,
    Union,
    held_labels,
    latest,
    next_seq,
    publish_tree,
    publisher_id,
    read_trees,
    union,
)
from distcache.jit._walk import check_way

if TYPE_CHECKING:
    from distcache.artifact import Artifact
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


@dataclass(frozen=True)
class Root:
    """One directory of a family, and the prefix its files carry in the tree."""

    path: Path
    prefix: str = ""


@dataclass(frozen=True)
class FamilySpec:
    """Where a tool keeps its JIT cache on this rank, and what makes its files valid
    elsewhere.

    Attributes:
        name: the family's name (``"inductor"``).
        key: everything the tool bakes into its files (tool and version, Python, the
            platform, an absolute path ...); trees are shared only under an equal key.
        roots: the directories, each with the prefix its files carry in the tree.
        environ: variables :meth:`Family.install` sets (when unset) and
            :meth:`Family.uninstall` removes again.
        pool_variable: a variable :meth:`Family.install` sets (when unset) to the
            installed pool's directory, for what the tool loads later in the process
            (Triton's cache manager) to use the session's pool, whichever way it was
            given.
        keep_times: the tool decides what to rebuild by modification times (ninja):
            trees list each file's time, restored when the file is placed.
    """

    name: str
    key: str
    roots: tuple[Root, ...]
    environ: Mapping[str, str] = field(default_factory=dict)
    pool_variable: str | None = None
    keep_times: bool = False


@dataclass
class Report:
    """What a family's last materialisation and publication did on this rank."""

    placed: Placed = field(default_factory=Placed)
    conflicts: int = 0
    published: int = 0
    refused: str | None = None


class Family:
    """A JIT compile cache kept in the pool (see :mod:`distcache.jit`).

    Args:
        spec: where the cache is and its key.
        pool: the pool :meth:`manifest` reads (``bind`` sets it later).
        link: hard-link files out of the pool instead of copying them.
        publisher: who this rank's trees say published them (default: a digest of
            the host name and the family's directories); a later tree of the same
            publisher supersedes its own earlier entries for the paths it lists.
    """

    def __init__(self, spec: FamilySpec, pool: ArtifactPool | None = None, *,
                 link: bool = False, publisher: str | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.pool = pool
        self.link = link
        self.publisher = publisher if publisher is not None else publisher_id(
            socket.gethostname(), [str(r.path) for r in spec.roots])
        self.report = Report()
        self._conflicts = ConflictLog()
        # Trees read (by digest; a tree never changes) and files hashed, kept between
        # calls so that a sync rereads neither.
        self._trees: dict[str, TreeManifest] = {}
        self._seen: Seen = {}
        self._set: dict[str, str | None] = {}

    def __repr__(self) -> str:
        roots = ", ".join(str(r.path) for r in self.spec.roots)
        return f"Family({self.name!r}, {roots})"

    @property
    def key(self) -> str:
        return self.spec.key

    def bind(self, pool: ArtifactPool) -> Family:
        self.pool = pool
        return self

    # -- Integration -------------------------------------------------------------

    def available(self) -> bool:
        return True

    def default_origin(self) -> str | None:
        return None

    def manifest(self) -> list[Artifact]:
        """Every tree and file of this family (all keys) the bound pool holds: the
        start-up prefetch unites them across ranks and moves them to every pool."""
        if self.pool is None:
            return []
        return held_labels(self.pool, self.name, self._trees)

    def install(self, pool: ArtifactPool, origin: Origin | None) -> None:
        """Fill the family's directories from ``pool`` (a directory that cannot be
        filled, of another user or unwritable, is logged, not raised: the engine
        compiles as it would without distcache), then set the family's variables
        where unset."""
        self.pool = pool
        try:
            self.materialize(pool)
        except (JitCacheError, PoolError, OSError) as exc:
            # A directory that cannot be filled (another user's, a file in its place,
            # read-only, a full disk) or a pool that cannot be read: the engine
            # compiles as it would without distcache.
            self.report.refused = str(exc)
            log.warning("%s: the cache was not filled from the pool (%s); the engine "
                        "compiles what it lacks", self.name, exc)
        self.set_environ(pool)

    def set_environ(self, pool: ArtifactPool) -> None:
        """Set the family's variables (``spec.environ``, and ``spec.pool_variable`` to
        ``pool``'s directory) where unset, for what the tool loads later in this
        process and in the processes it starts (Triton's cache manager);
        :meth:`uninstall` removes them again."""
        wanted = dict(self.spec.environ)
        if self.spec.pool_variable is not None:
            wanted[self.spec.pool_variable] = str(pool.root)
        for name, value in wanted.items():
            if name not in os.environ:
                self._set[name] = value
                os.environ[name] = value

    def uninstall(self) -> None:
        for name, value in self._set.items():
            if os.environ.get(name) == value:
                del os.environ[name]
        self._set.clear()

    def materialize_dir(self) -> Path | None:
        return self.spec.roots[0].path if self.spec.roots else None

    # -- the family's own calls --------------------------------------------------

    def materialize(self, pool: ArtifactPool | None = None) -> Placed:
        """Write the files of this key's trees that the directories lack (never
        replacing one); conflicting paths are left out and logged once.

        Raises:
            JitCacheError: a directory belongs to another user or is a link, cannot be
                created, or its filesystem refuses every write (full, over quota,
                read-only: :class:`~distcache.jit._walk.WholeFilesystem`, naming the
                file), once the family's other directories are filled.
            PoolError: the pool cannot be read.
        """
        pool = self._pool(pool)
        merged = self.merged(pool)
        self.report.conflicts = self._conflicts.report(self.name, self.key, merged.conflicts)
        entries = sorted(merged.entries.values(), key=lambda e: e.path)
        total = Placed()
        refused: JitCacheError | None = None  # raised once the other roots are filled
        # Longest prefix first, so a root nested in another gets its own files.
        for root in sorted(self.spec.roots, key=lambda r: -len(r.prefix)):
            mine = [e for e in entries if e.path.startswith(root.prefix) and not any(
                len(o.prefix) > len(root.prefix) and e.path.startswith(o.prefix)
                for o in self.spec.roots)]
            if not mine and not root.path.exists():
                continue
            try:
                placed = materialize_entries(pool, root.path, mine, family=self.name,
                                             prefix=root.prefix, link=self.link)
            except JitCacheError as exc:
                refused = refused or exc
                continue
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(placed, name))
        self.report.placed = total
        if refused is not None:
            raise refused
        return total

    def publish(self, pool: ArtifactPool | None = None) -> int:
        """Store what this rank built: the files its directories hold that no tree of
        this key lists with the same bytes, as one new tree; how many files it lists
        (0: nothing new). A file this publisher listed before with other bytes is an
        update: the new tree supersedes its old entry. A path another publisher
        listed with other bytes is published too, which makes it a conflict that no
        rank is served. Bytes that some tree of this key lists at that path (any
        publisher, any version) are what this rank received from the pool, not a
        build of its own: published again they would turn another publisher's later
        update of the file into a conflict. A family that keeps times publishes a
        file again for its bytes, not for its time (the pool keeps the time its bytes
        were first published with), except once where this publisher's entry, or
        one of a tree without a publisher, has no time (a tree from before times
        were kept).

        A file is stored whole or not at all: one whose ``stat`` moves while it is
        read is left out, and one that changed within
        :data:`~distcache.jit._place.RACY_NS` of the scan is stored only once it has
        been left alone for :data:`~distcache.jit._place.SETTLE_NS`: the call waits
        (once, at most that long) and reads it again, and one that changed meanwhile
        (a tool still writing it) is left for the next publication. Waiting, rather than leaving every recent file for
        later, lets the publication at exit, which has no later one, store what a
        build finished a moment before.

        Raises:
            JitCacheError: a directory, or one on the way to it, belongs to another
                user, or a link on the way is another user's
                (:func:`~distcache.jit._walk.check_way`); raised once what the
                family's other directories hold is stored.
            PoolError: the pool cannot be written.
        """
        pool = self._pool(pool)
        # One batch for the blobs and the tree that lists them: a capped pool
        # collects when it ends, around all of them, never between the two.
        with pool.batch():
            unique, refused = self._store(pool)
        self.report.published = len(unique)
        if refused is not None:
            raise refused
        return len(unique)

    def _store(self, pool: ArtifactPool) -> tuple[dict[str, TreeEntry], JitCacheError | None]:
        """:meth:`publish`'s work: store the new files and their tree; the entries it
        lists, and the first directory refused."""
        trees = read_trees(pool, self.name, self.key, cache=self._trees)
        known = union(trees)
        mine = {path: e for (who, path), e in latest(trees).items() if who == self.publisher}
        listed = {**known.entries, **mine}
        received = _Listed(trees, mine, known.entries)
        scanned: list[TreeEntry] = []
        fresh: list[Fresh] = []
        refused: JitCacheError | None = None  # raised once the other roots are stored
        for root in self.spec.roots:
            try:
                if not root.path.is_dir() or not check_way(root.path, family=self.name):
                    continue
            except JitCacheError as exc:
                refused = refused or exc
                continue
            scanned += scan_into(pool, root.path, root.prefix, listed, self._seen,
                                 times=self.spec.keep_times, fresh=fresh)
        waiting = [f for f in fresh if received.new(f.entry)]
        scanned += settle(pool, waiting, listed, times=self.spec.keep_times)
        unique = {e.path: e for e in scanned if received.new(e)}
        publish_tree(pool, TreeManifest(self.name, self.key, tuple(unique.values()),
                                        self.publisher, next_seq(trees, self.publisher)))
        return unique, refused

    def merged(self, pool: ArtifactPool | None = None) -> Union:
        """The union of this key's trees in ``pool`` (default: the bound one), each
        tree read once per family object, as :meth:`materialize` and :meth:`publish`
        read them.

        Raises:
            JitCacheError: no pool is bound and none is given.
        """
        return union(read_trees(self._pool(pool), self.name, self.key, cache=self._trees))

    def _pool(self, pool: ArtifactPool | None) -> ArtifactPool:
        chosen = pool if pool is not None else self.pool
        if chosen is None:
            raise JitCacheError(f"{self.name}: no pool is bound; pass one or call bind()",
                                family=self.name, path=None)
        return chosen


class _Listed:
    """What this key's trees say of a file a publication scanned: whether it is this
    publisher's own new work."""

    def __init__(self, trees: list[TreeManifest], mine: dict[str, TreeEntry],
                 served: dict[str, TreeEntry]) -> None:
        self.mine = mine
        #: path -> the entry served, for its time.
        self.served = served
        #: path -> every digest any tree gives it (superseded versions too).
        self.digests: dict[str, set[str]] = {}
        #: paths some tree with a publisher lists (one that may update it later).
        self.claimed: set[str] = set()
        for tree in trees:
            for entry in tree.entries:
                self.digests.setdefault(entry.path, set()).add(entry.sha256)
                if tree.publisher is not None:
                    self.claimed.add(entry.path)

    def new(self, entry: TreeEntry) -> bool:
        """Whether ``entry`` is this publisher's to publish: at a path it listed,
        bytes other than its latest entry's (an update), or the time that entry
        lacks; at another path, bytes no tree lists there, or the time missing from
        the served entry where only trees without a publisher (which no one updates)
        list the path."""
        own = self.mine.get(entry.path)
        if own is not None:
            return own.sha256 != entry.sha256 or (
                own.mtime_ns is None and entry.mtime_ns is not None)
        if entry.sha256 not in self.digests.get(entry.path, ()):
            return True
        served = self.served.get(entry.path)
        return (entry.path not in self.claimed and served is not None
                and served.sha256 == entry.sha256 and served.mtime_ns is None
                and entry.mtime_ns is not None)


#: Builds a family's spec from the environment (each tool's rules, in ``_tools``).
SpecFactory = Callable[[Mapping[str, str]], FamilySpec]

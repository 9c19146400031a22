"""Tree manifests: a directory family's files (relative path, sha256, mode, size, and
for a family that keeps them its modification times) under a family name and a key,
stored in the pool as ordinary verified objects.

A tree is canonical JSON, published as an object and labelled
``jit/<family>/<key id>/tree/<its sha256>``; each file it lists is an object labelled
``jit/<family>/<key id>/blob/<sha256>``. Labels name their own digest, so labels never
clash, every label survives the collective's moves and ``pool export``/``import``
unchanged, and the pool's journal carries them through ``sync`` like any artifact.
The key id is the first 24 hex digits of the key's sha256; the tree repeats the whole
key, and a tree whose family or key differs from its label's is ignored.

Many trees may exist for one key (each rank publishes what it built that others do
not have yet). A tree of format 2 names its *publisher* (a digest of the host and the
directories it scanned) and a sequence number, one more than the publisher's latest
tree it could read. :func:`union` merges them: for each publisher and path, the entry
of its latest tree that lists the path counts (a file that one publisher rewrites is
an update: its newer bytes supersede the older ones, which are no longer served);
a path that two publishers give different digests is a conflict and is served from
none of them. A tree of format 1 (no publisher) is a publisher of its own.

A family that keeps times (``FamilySpec.keep_times``: FlashInfer's JIT, whose ninja
decides what to rebuild by them) adds ``mtime_ns``, a list parallel to ``files`` (each
an integer number of nanoseconds, or ``null``), to either format: a reader that
predates it ignores the key and places the files as before, and a tree without it
(every tree of the other families, every tree published before) is read as ever, its
files placed with the time they are written. Where two publishers list one file with
the same bytes, :func:`union` serves an entry with a time before one without.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from distcache._log import get_logger
from distcache.artifact import Artifact, check_sha256, sha256_hex, validate_name
from distcache.errors import ArtifactNameError, JitCacheError
from distcache.store import ArtifactPool

log = get_logger(__name__)

#: Every label of a directory family starts with this.
PREFIX = "jit/"
#: Format of the tree object written (2: with publisher and sequence number; a tree
#: without a publisher is still written, and read, as format 1).
TREE_VERSION = 2
#: Formats read.
TREE_VERSIONS = (1, 2)
#: Permission bits a tree may carry: no set-uid, set-gid, sticky or group/other write.
MODE_MASK = 0o755
#: Largest tree object accepted (a tree is JSON; a few hundred bytes a file).
MAX_TREE_BYTES = 64 << 20
#: What a publisher looks like (:func:`publisher_id`).
PUBLISHER_RE = re.compile(r"[0-9a-f]{16}")
#: Largest modification time a tree may carry (ns since the epoch; what a signed 64
#: bit count holds). A tree with a time outside ``0..MAX_MTIME_NS`` is malformed;
#: placing clamps a time in the future to the time of placing.
MAX_MTIME_NS = 2**63 - 1


@dataclass(frozen=True, slots=True)
class TreeEntry:
    """One file of a tree: its path under the family's directory, digest, mode, size,
    and its modification time in ns (``None``: not kept, the file is placed with the
    time it is written)."""

    path: str
    sha256: str
    mode: int
    size: int
    mtime_ns: int | None = None


@dataclass(frozen=True, slots=True)
class TreeManifest:
    """A family's files under one key, as one rank saw them; ``publisher`` (``None``:
    format 1, a publisher of its own) and its ``seq`` order one publisher's trees."""

    family: str
    key: str
    entries: tuple[TreeEntry, ...]
    publisher: str | None = None
    seq: int = 0

    def encode(self) -> bytes:
        """The canonical JSON bytes (sorted paths), so equal trees are one object."""
        ordered = sorted(self.entries, key=lambda e: e.path)
        files = [[e.path, e.sha256, e.mode, e.size] for e in ordered]
        doc: dict[str, object] = {"version": 1, "family": self.family, "key": self.key,
                                  "files": files}
        if self.publisher is not None:
            doc.update(version=TREE_VERSION, publisher=self.publisher, seq=self.seq)
        if any(e.mtime_ns is not None for e in ordered):
            doc["mtime_ns"] = [e.mtime_ns for e in ordered]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> TreeManifest:
        """Parse and check a tree object.

        Raises:
            JitCacheError: not a tree of this format, or an unsafe path, a bad digest,
                mode or size.
        """
        try:
            doc = json.loads(data.decode("utf-8"))
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            version = doc.get("version")
            if version not in TREE_VERSIONS:
                raise ValueError(f"tree format {version!r}, not one of {TREE_VERSIONS}")
            family, key = str(doc["family"]), str(doc["key"])
            publisher, seq = None, 0
            if version >= 2:
                publisher, seq = doc["publisher"], doc["seq"]
                if not isinstance(publisher, str) or not PUBLISHER_RE.fullmatch(publisher):
                    raise ValueError(f"bad publisher {publisher!r}")
                if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                    raise ValueError(f"bad sequence number {seq!r}")
            files, times = doc["files"], doc.get("mtime_ns")
            if times is None:
                times = [None] * len(files)
            elif not isinstance(times, list) or len(times) != len(files):
                raise ValueError("mtime_ns is not a list parallel to files")
            entries = []
            for (path, sha, mode, size), mtime in zip(files, times, strict=True):
                if not isinstance(mode, int) or not isinstance(size, int) or size < 0:
                    raise ValueError(f"bad mode or size for {path!r}")
                entries.append(TreeEntry(validate_name(path), check_sha256(sha),
                                         mode & MODE_MASK, size, _mtime(path, mtime)))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError,
                ArtifactNameError) as exc:  # RecursionError: JSON nested too deep
            raise JitCacheError(f"malformed tree manifest: {exc}", family=None,
                                path=None) from exc
        return cls(family, key, tuple(entries), publisher, seq)


def _mtime(path: object, value: object) -> int | None:
    """A tree's time for ``path``: ``None`` or an integer in ``0..MAX_MTIME_NS``.

    Raises:
        ValueError: anything else (a float, a boolean, a negative or huge number).
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not (
            0 <= value <= MAX_MTIME_NS):
        raise ValueError(f"bad modification time {value!r} for {path!r}")
    return value


def tree_bytes(pool: ArtifactPool, sha: str) -> bytes | None:
    """The verified bytes of the tree object ``sha``; ``None`` when the pool lacks it
    or it is larger than :data:`MAX_TREE_BYTES`, which is checked before anything is
    read (a label may name any object, a large one too)."""
    try:
        if os.stat(pool.layout.object_path(sha)).st_size > MAX_TREE_BYTES:
            return None
    except OSError:
        return None
    data = pool.get(sha)
    return None if data is None or len(data) > MAX_TREE_BYTES else data


def publisher_id(host: str, directories: Iterable[str]) -> str:
    """The publisher a tree names: 16 hex digits of the host and the directories a
    family scans (one such pair rewriting a file updates it, never conflicts). A
    directory whose name is not UTF-8 is hashed like any other (:func:`_utf8`)."""
    text = "\n".join([host, *directories])
    return sha256_hex(_utf8(text))[:16]


def next_seq(trees: Iterable[TreeManifest], publisher: str) -> int:
    """One more than the latest sequence number of ``publisher``'s trees."""
    return 1 + max((t.seq for t in trees if t.publisher == publisher), default=0)


def key_id(key: str) -> str:
    """The 24 hex digits of ``key``'s sha256 that labels carry."""
    return sha256_hex(_utf8(key))[:24]


def _utf8(text: str) -> bytes:
    """``text`` in UTF-8, lone surrogates included (how Python reads a path that is
    not UTF-8, a cache directory named in another encoding, and what a tree's JSON
    may carry): such a key or directory is hashed like any other, never refused."""
    return text.encode("utf-8", "surrogatepass")


def family_prefix(family: str, key: str | None = None) -> str:
    """``jit/<family>/`` or, with a key, ``jit/<family>/<key id>/``."""
    return f"{PREFIX}{family}/" if key is None else f"{PREFIX}{family}/{key_id(key)}/"


def tree_label(family: str, key: str, sha: str) -> str:
    return f"{family_prefix(family, key)}tree/{sha}"


def blob_label(family: str, key: str, sha: str) -> str:
    return f"{family_prefix(family, key)}blob/{sha}"


def read_trees(pool: ArtifactPool, family: str, key: str,
               names: Mapping[str, str] | None = None,
               cache: dict[str, TreeManifest] | None = None) -> list[TreeManifest]:
    """The trees the pool holds for ``family`` under ``key`` (verified reads; a
    missing, corrupt or malformed tree is skipped and logged). ``cache`` keeps the
    trees read, by digest (a tree never changes), for the next call; it may hold
    other keys' trees, so a tree from it is checked like one read."""
    prefix = f"{family_prefix(family, key)}tree/"
    labels = pool.names() if names is None else names
    trees: list[TreeManifest] = []
    for name, sha in sorted(labels.items()):
        # A tree's label names its own digest; one that names another is not a tree.
        if not name.startswith(prefix) or name[len(prefix):] != sha:
            continue
        if cache is not None and sha in cache:
            cached = cache[sha]
            # The label is under this key, but the tree it names may be another's.
            if cached.family == family and cached.key == key:
                trees.append(cached)
            continue
        data = tree_bytes(pool, sha)
        if data is None:
            continue
        try:
            tree = TreeManifest.decode(data)
        except JitCacheError as exc:
            log.warning("pool %s: ignoring tree %s: %s", pool.root, name, exc)
            continue
        if tree.family == family and tree.key == key:
            trees.append(tree)
            if cache is not None:
                cache[sha] = tree
    return trees


@dataclass(frozen=True, slots=True)
class Union:
    """What several trees of one key say together."""

    #: path -> the entry every tree that lists the path agrees on.
    entries: dict[str, TreeEntry]
    #: path -> the distinct digests trees give it (two or more: served from none).
    conflicts: dict[str, tuple[str, ...]]


def latest(trees: Iterable[TreeManifest]) -> dict[tuple[str, str], TreeEntry]:
    """``(publisher, path) -> entry`` of that publisher's latest tree listing the path
    (highest ``seq``; on a tie, the tree given later: :func:`read_trees` gives them by
    digest, so every reader picks the same). A format 1 tree is a publisher of its
    own."""
    found: dict[tuple[str, str], tuple[int, TreeEntry]] = {}
    for index, tree in enumerate(trees):
        who = tree.publisher if tree.publisher is not None else f"v1:{index}"
        for entry in tree.entries:
            have = found.get((who, entry.path))
            if have is None or tree.seq >= have[0]:
                found[(who, entry.path)] = (tree.seq, entry)
    return {k: entry for k, (_seq, entry) in found.items()}


def union(trees: Iterable[TreeManifest]) -> Union:
    """Merge trees: each publisher's latest entry per path (:func:`latest`); a path
    that publishers give two digests is a conflict, left out of ``entries``. Of the
    publishers that agree, the first (by publisher) that lists a time is served, else
    the first."""
    seen: dict[str, TreeEntry] = {}
    shas: dict[str, set[str]] = {}
    for (_who, path), entry in sorted(latest(trees).items()):
        have = seen.get(path)
        if have is None or (have.mtime_ns is None and entry.mtime_ns is not None):
            seen[path] = entry
        shas.setdefault(path, set()).add(entry.sha256)
    conflicts = {p: tuple(sorted(s)) for p, s in shas.items() if len(s) > 1}
    return Union({p: e for p, e in seen.items() if p not in conflicts}, conflicts)


class ConflictLog:
    """Logs each conflicting path once per process (per family and key)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, str]] = set()

    def report(self, family: str, key: str, conflicts: Mapping[str, tuple[str, ...]]) -> int:
        """Log the conflicts not logged before; return how many are new."""
        new = [p for p in sorted(conflicts) if (family, key, p) not in self._seen]
        for path in new:
            self._seen.add((family, key, path))
            log.warning("%s: ranks produced different bytes at %s (%s); it is not shared",
                        family, path, ", ".join(s[:12] for s in conflicts[path]))
        return len(new)


def publish_tree(pool: ArtifactPool, tree: TreeManifest) -> Artifact | None:
    """Store ``tree`` (its blobs are already in the pool) and label it and its blobs;
    the tree's artifact, or ``None`` for an empty tree. In a batch of its own, or the
    caller's (one that also stored the blobs): a capped pool collects once the batch
    ends, keeping the tree and every blob it lists, rather than collecting the blobs
    to make room for the tree that names them.

    Raises:
        PoolError: the pool cannot be written.
    """
    if not tree.entries:
        return None
    data = tree.encode()
    blobs = {e.sha256 for e in tree.entries}
    with pool.batch():
        pool.hold(blobs)  # blobs stored before the batch, or by another process
        sha = pool.put(data)
        pool.remember([Artifact(blob_label(tree.family, tree.key, s), s)
                       for s in sorted(blobs)])
        artifact = Artifact(tree_label(tree.family, tree.key, sha), sha, len(data))
        # The tree's label last: a reader that sees it finds every blob labelled.
        pool.remember([artifact])
    return artifact


def held_labels(pool: ArtifactPool, family: str,
                cache: dict[str, TreeManifest] | None = None) -> list[Artifact]:
    """The labels of ``family`` (all keys) whose object this pool holds: every tree,
    and the files the trees serve (:func:`union`; neither a version its publisher
    superseded nor a conflicting one). What the start-up prefetch moves to the pools
    that lack it."""
    prefix = family_prefix(family)
    names = {n: s for n, s in pool.names().items() if n.startswith(prefix)}
    grouped: dict[str, list[TreeManifest]] = {}
    keep: set[str] = set()
    for name, sha in sorted(names.items()):
        parts = name[len(prefix):].split("/")
        if len(parts) != 3 or parts[1] != "tree" or parts[2] != sha:
            continue
        kid = parts[0]
        keep.add(name)
        tree = _read_tree(pool, sha, cache)
        if tree is not None and tree.family == family and key_id(tree.key) == kid:
            grouped.setdefault(tree.key, []).append(tree)
    for key, trees in grouped.items():
        keep |= {blob_label(family, key, e.sha256) for e in union(trees).entries.values()}
    return [Artifact(name, sha) for name, sha in sorted(names.items())
            if name in keep and pool.has(sha)]


def _read_tree(pool: ArtifactPool, sha: str,
               cache: dict[str, TreeManifest] | None) -> TreeManifest | None:
    """The tree object ``sha`` (verified read), or ``None``; ``cache`` as in
    :func:`read_trees`."""
    if cache is not None and sha in cache:
        return cache[sha]
    data = tree_bytes(pool, sha)
    if data is None:
        return None
    try:
        tree = TreeManifest.decode(data)
    except JitCacheError:
        return None
    if cache is not None:
        cache[sha] = tree
    return tree

"""The collective prefetch and sync at world size N, as N thread-ranks.

Fakes keep these tests offline and exact: a dict-backed pool (one shared store per
pool id, as ranks on one filesystem would see) and a counting origin.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, check_sha256, sha256_hex, verify_bytes
from distcache.collective import PHASES, PrefetchReport, SyncState, _stream, prefetch, sync
from distcache.collective._bucket import decode_bucket
from distcache.collective._download import download_objects
from distcache.collective._plan import make_plan
from distcache.comm import LocalCommunicator, ThreadGroup
from distcache.comm._base import Communicator
from distcache.errors import (
    ArtifactNotFound,
    DistcacheError,
    IntegrityError,
    ManifestMismatchError,
    OriginError,
    PoolError,
    PrefetchError,
)

# -- fakes -------------------------------------------------------------------------


class Store:
    """The bytes on one 'filesystem'; every FakePool with the same id shares it."""

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.objects: dict[str, bytes] = {}
        self.labels: dict[str, str] = {}
        self.journal: list[str] = []
        self.lock = threading.Lock()
        self.fail_put: type[Exception] | None = None
        self.probes: dict[str, str] = {}


class FakeIdentity:
    """The probes of one 'filesystem': a pool sees only those placed in its Store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @property
    def pool_id(self) -> str:
        return self.store.pool_id

    @contextlib.contextmanager
    def probe(self, name: str, token: str) -> Iterator[bool]:
        self.store.probes[name] = token
        try:
            yield True
        finally:
            del self.store.probes[name]

    def sees(self, name: str, token: str) -> bool:
        return self.store.probes.get(name) == token

    def renew(self) -> str:
        self.store.pool_id = f"{self.store.pool_id}+"
        return self.store.pool_id

    def reload(self) -> str:
        return self.store.pool_id


class FakePool:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.identity = FakeIdentity(store)

    @property
    def pool_id(self) -> str:
        return self.store.pool_id

    def has(self, sha256: str) -> bool:
        return sha256 in self.store.objects

    def holding(self, shas: Iterable[str]) -> list[bool]:
        return [self.has(s) for s in shas]

    def get(self, sha256: str, *, trust_own: bool = False) -> bytes | None:
        return self.store.objects.get(sha256)

    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        sha = sha256_hex(data)
        if sha256 is not None:
            verify_bytes(data, sha256)
        if self.store.fail_put is not None:
            raise self.store.fail_put(f"no space left on {self.pool_id}")
        with self.store.lock:
            if sha not in self.store.objects:
                self.store.objects[sha] = bytes(data)
                self.store.journal.append(sha)
        return sha

    def download(self, artifact: Artifact, origin: Any) -> int:
        data = origin.fetch(artifact)
        self.put(data, artifact.sha256)
        return len(data)

    def batch(self, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def hold(self, shas: Iterable[str]) -> None:
        for sha in shas:  # no size cap to keep them under; a bad sha is refused alike
            check_sha256(sha)

    def remember(self, artifacts: Iterable[Artifact]) -> None:
        with self.store.lock:
            for a in artifacts:
                self.store.labels[a.name] = a.sha256

    label = remember

    def names(self) -> dict[str, str]:
        return dict(self.store.labels)

    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]:
        with self.store.lock:
            return list(self.store.journal[cursor:]), len(self.store.journal)


class FakeOrigin:
    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.requests: Counter[str] = Counter()
        self.by_thread: Counter[str] = Counter()
        self.fail: set[str] = set()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "fake://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        with self._lock:
            self.requests[artifact.name] += 1
            self.by_thread[threading.current_thread().name] += 1
        if artifact.name in self.fail:
            raise OriginError(f"500 from fake://origin/{artifact.name}", status=500)
        return self.blobs[artifact.sha256]

    @property
    def total(self) -> int:
        return sum(self.requests.values())


def make_blobs(
    count: int, *, seed: int = 0, low: int = 100, high: int = 3000
) -> tuple[list[Artifact], dict[str, bytes]]:
    rng = random.Random(seed)
    arts, blobs = [], {}
    for i in range(count):
        data = rng.randbytes(rng.randrange(low, high))
        sha = sha256_hex(data)
        arts.append(Artifact(f"cubins/k{i:03d}.cubin", sha, len(data)))
        blobs[sha] = data
    return arts, blobs


LAYOUTS = {
    # 8 ranks over 4 nodes, in the three pool layouts that must work without config.
    "node-local": lambda r: f"node{r // 2}",
    "per-rank": lambda r: f"rank{r}",
    "shared": lambda r: "nfs",
}


def make_pools(size: int, layout: Callable[[int], str]) -> tuple[list[FakePool], dict[str, Store]]:
    stores: dict[str, Store] = {}
    pools = []
    for r in range(size):
        pid = layout(r)
        stores.setdefault(pid, Store(pid))
        pools.append(FakePool(stores[pid]))
    return pools, stores


def run_ranks(
    group: ThreadGroup,
    fn: Callable[[int], Any],
    ranks: Sequence[int] | None = None,
    join: float = 30,
) -> list[Any]:
    """Run ``fn(rank)`` on each rank's thread; return results or raised exceptions."""
    out: list[Any] = [None] * group.size
    todo = range(group.size) if ranks is None else ranks

    def target(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=target, args=(r,), name=f"rank{r}") for r in todo]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
        assert not t.is_alive(), "a rank hung"
    return out


def group8() -> ThreadGroup:
    return ThreadGroup(8, [f"node{r // 2}" for r in range(8)], timeout=20)


def ok(results: list[Any]) -> list[PrefetchReport]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class Tally:
    """What each world rank did on any communicator, children included."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: Counter[tuple[int, str]] = Counter()
        #: Artifact bytes each world rank received (bucket payloads, tables excluded).
        self.payload: Counter[int] = Counter()


class CountingComm:
    """A communicator that tallies what its world rank does, through every split."""

    def __init__(self, inner: Communicator, world_rank: int, tally: Tally) -> None:
        self.inner = inner
        self.world_rank = world_rank
        self.tally = tally

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def node_id(self) -> str:
        return self.inner.node_id

    @property
    def backend(self) -> str:
        return self.inner.backend

    def _count(self, op: str) -> None:
        with self.tally.lock:
            self.tally.ops[self.world_rank, op] += 1

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        self._count("broadcast_bytes")
        got = self.inner.broadcast_bytes(data, root, timeout=timeout)
        if self.rank != root:
            _, entries = decode_bucket(got)
            with self.tally.lock:
                self.tally.payload[self.world_rank] += sum(len(v or b"") for _, v in entries)
        return got

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        self._count("allgather_object")
        return self.inner.allgather_object(obj, timeout=timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._count("barrier")
        self.inner.barrier(timeout=timeout)

    def split(self, color: int) -> Communicator:
        self._count("split")
        return CountingComm(self.inner.split(color), self.world_rank, self.tally)


def counted(group: ThreadGroup) -> tuple[list[Communicator], Tally]:
    tally = Tally()
    return [CountingComm(group.comm(r), r, tally) for r in range(group.size)], tally


# -- behaviour ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_missing_artifact_is_downloaded_once_and_reaches_every_pool(layout: str) -> None:
    arts, blobs = make_blobs(24)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(8, LAYOUTS[layout])
    group = group8()
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=8000
            ),
        )
    )

    assert origin.total == 24 and max(origin.requests.values()) == 1
    for store in stores.values():
        assert store.objects == blobs
        assert store.labels == {a.name: a.sha256 for a in arts}
    first = reports[0]
    assert all(r == first for r in reports), "the report is identical on every rank"
    assert first.downloads == 24 and first.origin_bytes == sum(map(len, blobs.values()))
    assert len(first.downloaders) > 1, "downloads are spread over ranks"
    assert first.pools == len(stores)
    assert first.objects_published == 24 * len(stores)
    assert first.pool_hits == 0
    assert set(first.seconds) == set(PHASES)
    if layout == "shared":
        assert first.broadcasts == 0 and first.writers == (0,)
        assert len(first.downloaders) == 8
    else:
        assert first.broadcast_bytes >= first.origin_bytes


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_second_prefetch_touches_neither_origin_nor_communicator_bytes(layout: str) -> None:
    arts, blobs = make_blobs(10)
    origin = FakeOrigin(blobs)
    pools, _ = make_pools(8, LAYOUTS[layout])
    group = group8()
    ok(run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin)))
    calls_before = list(group.calls)
    reports = ok(
        run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin))
    )
    assert origin.total == 10
    assert reports[0].downloads == 0 and reports[0].broadcast_bytes == 0
    assert reports[0].pool_hits == 10 and reports[0].objects_published == 0
    # agree, discover, report: three all-gathers, and where ranks claim one pool the
    # probe round that shows they see it (two); nothing else
    probe_round = 0 if layout == "per-rank" else 2
    assert [a - b for a, b in zip(group.calls, calls_before, strict=True)] == [3 + probe_round] * 8


def test_partial_pools_get_only_what_they_lack_and_nothing_is_downloaded() -> None:
    arts, blobs = make_blobs(6)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    for i, a in enumerate(arts):  # each artifact already on one node
        stores[f"node{i % 4}"].objects[a.sha256] = blobs[a.sha256]
    group = group8()
    reports = ok(
        run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin))
    )
    assert origin.total == 0
    assert all(s.objects == blobs for s in stores.values())
    assert reports[0].objects_published == 6 * 3


@pytest.fixture
def patient_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sources wait for each download rather than send early (the buckets of a move
    after the fetch), so that a test may count broadcasts exactly."""
    monkeypatch.setattr(_stream, "PATIENCE", 60.0)


@pytest.mark.usefixtures("patient_sources")
def test_many_small_artifacts_travel_in_few_broadcasts() -> None:
    arts, blobs = make_blobs(200, low=100, high=200)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(4, lambda r: f"rank{r}")
    group = ThreadGroup(4, timeout=20)
    total = sum(map(len, blobs.values()))
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=total
            ),
        )
    )
    # Each of the 4 sources sends its ~50 downloads in one bucket.
    assert reports[0].broadcasts == 4
    assert all(s.objects == blobs for s in stores.values())
    # On the job's communicator: 3 all-gathers + the writers' split (the move starts
    # beside the fetch) + fetch heartbeat + one move heartbeat, which agrees on the
    # move's failures. On the writers' own: rank map + 4 broadcasts.
    assert group.calls == [3 + 1 + 1 + 1] * 4
    (writers,) = group._children.values()
    assert writers.calls == [1 + 4] * 4


def test_memory_in_flight_is_bounded_by_a_few_buckets() -> None:
    arts, blobs = make_blobs(60, low=1000, high=20_000, seed=3)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(4, lambda r: f"rank{r}")
    group = ThreadGroup(4, timeout=20)
    bucket = 30_000
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=bucket
            ),
        )
    )
    largest = max(map(len, blobs.values()))
    overhead = 16 * len(arts) + 16  # bucket tables and trailer
    report = reports[0]
    # A source holds the bucket in flight, the next one it builds and the artifact
    # that did not fit (2 x bucket + largest); a receiver at most three buckets (one
    # arriving, one queued, one being published). Every artifact here is smaller than
    # a bucket, so no message exceeds bucket + its table.
    assert largest < bucket
    assert bucket < report.peak_bytes <= 3 * bucket + overhead
    assert report.broadcasts >= sum(map(len, blobs.values())) // (bucket + largest)
    assert all(s.objects == blobs for s in stores.values())


@pytest.mark.usefixtures("patient_sources")
def test_artifact_larger_than_a_bucket_travels_alone() -> None:
    arts, blobs = make_blobs(5, low=5000, high=6000)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(2, lambda r: f"rank{r}")
    group = ThreadGroup(2, timeout=20)
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=1000
            ),
        )
    )
    assert reports[0].broadcasts == 5
    assert all(s.objects == blobs for s in stores.values())


def test_manifest_mismatch_raises_the_same_error_on_every_rank() -> None:
    arts, blobs = make_blobs(5)
    origin = FakeOrigin(blobs)
    pools, _ = make_pools(4, lambda r: f"rank{r}")
    group = ThreadGroup(4, timeout=20)
    lists = [arts, arts, arts[:4], list(reversed(arts))]  # order does not matter
    results = run_ranks(
        group, lambda r: prefetch(lists[r], comm=group.comm(r), pool=pools[r], origin=origin)
    )
    assert all(isinstance(e, ManifestMismatchError) for e in results)
    assert len({str(e) for e in results}) == 1
    groups = results[0].groups
    assert sorted(groups.values()) == [[0, 1, 3], [2]]
    assert origin.total == 0


def test_origin_failure_on_one_rank_raises_the_same_prefetch_error_everywhere() -> None:
    arts, blobs = make_blobs(16)
    origin = FakeOrigin(blobs)
    origin.fail = {arts[5].name}
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    group = group8()
    results = run_ranks(
        group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin)
    )
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({(e.artifact, e.rank, e.host, e.cause, str(e)) for e in results}) == 1
    err = results[0]
    assert err.artifact == arts[5].name
    assert err.host == f"node{err.rank // 2}"
    assert arts[5].name in str(err) and f"rank {err.rank}" in str(err) and err.host in str(err)
    assert "OriginError" in err.cause
    assert origin.requests[arts[5].name] == 1
    # Nothing partial: what is in a pool is whole; a later prefetch resumes from it.
    origin.fail = set()
    before = origin.total
    fresh = group8()  # a failed group's barrier may be broken; a new job gets a new one
    report = ok(
        run_ranks(fresh, lambda r: prefetch(arts, comm=fresh.comm(r), pool=pools[r], origin=origin))
    )[0]
    assert all(s.objects == blobs for s in stores.values())
    assert origin.total - before == report.downloads < 16 + 1
    assert origin.requests[arts[5].name] == 2


class RuleOrigin(FakeOrigin):
    """Fails ``bad`` with the error ``make`` builds; serves everything else."""

    def __init__(self, blobs: dict[str, bytes], bad: str, make: Callable[[str], Exception]) -> None:
        super().__init__(blobs)
        self.bad = bad
        self.make = make

    def fetch(self, artifact: Artifact) -> bytes:
        if artifact.name == self.bad:
            with self._lock:
                self.requests[artifact.name] += 1
            raise self.make(artifact.name)
        return super().fetch(artifact)


@pytest.mark.parametrize(
    ("make", "others_go_on"),
    [
        (lambda name: IntegrityError(f"{name}: digest mismatch", sha256="0" * 64), True),
        (lambda name: ArtifactNotFound(f"404 for {name}", status=404, name=name), True),
        (lambda name: ArtifactNotFound(f"{name} is not in the mirror", name=name), True),
        # "Not found" is a type, not a status: a bare status does not say it.
        (lambda name: OriginError(f"404 for {name}", status=404, name=name), False),
        (lambda name: OriginError(f"500 for {name}", status=500, name=name), False),
        (lambda name: OriginError(f"connection refused for {name}", name=name), False),
        (lambda name: PoolError(f"no space left writing {name}"), False),
    ],
    ids=[
        "digest-mismatch",
        "not-found",
        "missing-file",
        "bare-404-status",
        "server-error",
        "unreachable",
        "pool",
    ],
)
def test_only_a_failure_of_one_artifact_lets_the_other_downloads_go_on(
    make: Callable[[str], Exception], others_go_on: bool
) -> None:
    arts, blobs = make_blobs(8)
    origin = RuleOrigin(blobs, arts[0].name, make)
    store = Store("p")
    # One worker takes the artifacts in order, so the bad one fails before the rest start.
    got = download_objects(FakePool(store), origin, arts, workers=1, timeout=30)
    assert got.failure is not None and got.failure[0] == arts[0].name
    assert type(got.failure[1]) is type(make("x"))
    fetched = arts[1:] if others_go_on else []
    assert got.downloads == len(fetched)
    assert set(store.objects) == {a.sha256 for a in fetched}
    assert origin.requests == {a.name: 1 for a in [arts[0], *fetched]}


def test_full_disk_on_a_receiving_writer_fails_every_rank_alike() -> None:
    arts, blobs = make_blobs(8)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(4, lambda r: f"rank{r}")
    stores["rank2"].fail_put = PoolError
    group = ThreadGroup(4, timeout=20)
    results = run_ranks(
        group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin)
    )
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert {e.rank for e in results} == {2}
    assert len({str(e) for e in results}) == 1
    assert "PoolError" in results[0].cause and "no space" in str(results[0])


def test_a_rank_that_never_arrives_makes_the_others_fail_within_the_timeout() -> None:
    arts, blobs = make_blobs(4)
    origin = FakeOrigin(blobs)
    pools, _ = make_pools(4, lambda r: f"rank{r}")
    group = ThreadGroup(4, timeout=0.5)
    results = run_ranks(
        group,
        lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r], origin=origin, timeout=0.5),
        ranks=[0, 1, 2],
        join=10,
    )
    for r in (0, 1, 2):
        assert isinstance(results[r], PrefetchError), results[r]
        assert "CollectiveTimeout" in results[r].cause
    assert origin.total == 0


def test_world_size_one_prefetch_downloads_into_the_local_pool() -> None:
    arts, blobs = make_blobs(3)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(1, lambda r: "only")
    report = prefetch(arts + arts[:1], comm=LocalCommunicator("here"), pool=pools[0], origin=origin)
    assert report.downloads == 3 and report.artifacts == 3 and report.broadcasts == 0
    assert stores["only"].objects == blobs
    assert "3 downloads" in report.summary()


def test_two_names_for_the_same_bytes_are_one_object() -> None:
    arts, blobs = make_blobs(2)
    alias = Artifact("other/alias.cubin", arts[0].sha256)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(2, lambda r: f"rank{r}")
    group = ThreadGroup(2, timeout=20)
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch([*arts, alias], comm=group.comm(r), pool=pools[r], origin=origin),
        )
    )
    assert origin.total == 2 and reports[0].artifacts == 3 and reports[0].objects == 2
    assert stores["rank1"].labels["other/alias.cubin"] == arts[0].sha256


def test_sync_repairs_a_warm_up_that_ran_on_one_rank_only() -> None:
    arts, blobs = make_blobs(5)
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    # Warm-up on rank 3 only: lazily fetched into its node's pool.
    for a in arts:
        pools[3].put(blobs[a.sha256], a.sha256)
    pools[3].remember(arts)
    group = group8()
    state = [SyncState() for _ in range(8)]
    reports = ok(
        run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r], state=state[r]))
    )
    assert all(s.objects == blobs for s in stores.values())
    assert all(s.labels == {a.name: a.sha256 for a in arts} for s in stores.values())
    assert reports[0].downloads == 0 and reports[0].objects_published == 5 * 3
    assert all(r == reports[0] for r in reports)
    # Nothing new since: the next sync moves nothing and sends no object ids.
    again = ok(run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r], state=state[r])))
    assert again[0].broadcasts == 0 and again[0].objects <= 5


def test_sync_without_state_compares_whole_journals() -> None:
    arts, blobs = make_blobs(3)
    pools, stores = make_pools(4, lambda r: f"rank{r}")
    pools[0].put(blobs[arts[0].sha256])
    pools[2].put(blobs[arts[1].sha256])
    group = ThreadGroup(4, timeout=20)
    ok(run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r])))
    expected = {a.sha256: blobs[a.sha256] for a in arts[:2]}
    assert all(s.objects == expected for s in stores.values())
    reports = ok(run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r])))
    assert reports[0].objects == 2 and reports[0].broadcasts == 0


_MPI_ONLY = """
import sys
from pathlib import Path
from distcache.comm import from_mpi
from distcache.origins import DirOrigin
from distcache.store._pool import ArtifactPool
from distcache.collective import prefetch
from distcache.artifact import parse_checksums

root = Path(sys.argv[1])
comm = from_mpi()
arts = parse_checksums((root / "mirror" / "checksums.txt").read_text())
pool = ArtifactPool(root / f"pool{comm.rank}")
report = prefetch(arts, comm=comm, pool=pool, origin=DirOrigin(root / "mirror"), timeout=60)
assert report.downloads == len(arts) and report.pools == comm.size, report
assert sorted(pool.objects()) == sorted(a.sha256 for a in arts)
assert "torch" not in sys.modules, "an MPI-only prefetch imported torch"
print("ok", comm.rank, flush=True)
"""


def test_mpi_only_prefetch_never_imports_torch(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess

    from distcache.testing import make_artifacts

    mpirun = Path(sys.executable).with_name("mpirun")
    if not mpirun.exists():
        pytest.fail(f"{mpirun} is missing; the test environment installs Open MPI")
    make_artifacts(tmp_path / "mirror", 6, min_size=500, max_size=5000)
    script = tmp_path / "mpi_only.py"
    script.write_text(_MPI_ONLY)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(mpirun), "-n", "2", "--oversubscribe", sys.executable, str(script), str(tmp_path)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("mpirun did not finish within 120 s")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "ok 0" in text and "ok 1" in text


# -- with the real pool and the loopback HTTP origin -------------------------------


def test_real_pools_and_loopback_origin_fetch_each_artifact_once(tmp_path: Path) -> None:
    from distcache.origins import HttpOrigin
    from distcache.store._pool import ArtifactPool
    from distcache.testing import LoopbackOrigin, make_artifacts

    arts = make_artifacts(tmp_path / "mirror", 12, min_size=2000, max_size=20_000)
    roots = [tmp_path / f"node{r // 2}" for r in range(8)]
    group = group8()
    with LoopbackOrigin(tmp_path / "mirror") as server:
        origin = HttpOrigin(server.url, retries=0)
        pools = [ArtifactPool(root) for root in roots]

        def run(r: int) -> PrefetchReport:
            return prefetch(
                arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=50_000
            )

        first = ok(run_ranks(group, run))[0]
        assert server.total_requests == 12 and max(server.requests.values()) == 1
        assert len(first.downloaders) > 1 and first.pools == 4
        for root in set(roots):
            pool = ArtifactPool(root)
            assert sorted(pool.objects()) == sorted(a.sha256 for a in arts)
            assert pool.names() == {a.name: a.sha256 for a in arts}
        second = ok(run_ranks(group, run))[0]
        assert server.total_requests == 12
        assert second.downloads == 0 and second.broadcast_bytes == 0 and second.pool_hits == 12


def test_real_pools_sync_spreads_a_lazy_fetch(tmp_path: Path) -> None:
    from distcache.store._pool import ArtifactPool

    data = b"lazily fetched kernel" * 100
    art = Artifact("cubins/lazy.cubin", sha256_hex(data))
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    pools[1].put(data, art.sha256)
    pools[1].remember([art])
    group = ThreadGroup(3, timeout=20)
    states = [SyncState() for _ in range(3)]
    ok(run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r], state=states[r])))
    for pool in pools:
        assert pool.get(art.sha256) == data and pool.names() == {art.name: art.sha256}


def test_sync_returns_before_the_flush_of_what_it_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.store import _durability
    from distcache.store._pool import ArtifactPool

    started, release = threading.Event(), threading.Event()

    def slow_sync(path: object) -> bool:
        started.set()
        assert release.wait(30)
        return True

    data = b"moved at a safe point" * 100
    art = Artifact("cubins/moved.cubin", sha256_hex(data))
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    pools[1].put(data, art.sha256)
    pools[1].remember([art])
    monkeypatch.setattr(_durability, "sync_filesystem", slow_sync)
    group = ThreadGroup(2, timeout=20)
    reports = ok(run_ranks(group, lambda r: sync(comm=group.comm(r), pool=pools[r])))
    # Both ranks returned while the receiving pool's one flush was still running.
    assert reports[0].objects_published == 1
    assert started.wait(30)
    flushers = [t for t in threading.enumerate() if t.name == "distcache-flush"]
    assert len(flushers) == 1 and flushers[0].is_alive() and not flushers[0].daemon
    assert pools[0].get(art.sha256) == data
    release.set()
    flushers[0].join(30)
    assert not flushers[0].is_alive()


# -- bytes go only to the pools that lack them -------------------------------------


def test_replaced_node_receives_everything_and_warm_writers_receive_nothing() -> None:
    arts, blobs = make_blobs(20, low=1000, high=5000)
    total = sum(map(len, blobs.values()))
    origin = FakeOrigin(blobs)
    layout = lambda r: f"node{r // 2}"  # noqa: E731
    pools, stores = make_pools(10, layout)
    for node in range(4):  # nodes 0-3 are warm; node 4 was replaced with an empty disk
        stores[f"node{node}"].objects.update(blobs)
    group = ThreadGroup(10, [f"node{r // 2}" for r in range(10)], timeout=20)
    comms, tally = counted(group)
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=comms[r], pool=pools[r], origin=origin, bucket_bytes=8000
            ),
        )
    )
    assert origin.total == 0
    assert all(s.objects == blobs for s in stores.values())
    assert [tally.payload[r] for r in range(10)] == [0] * 8 + [total, 0]
    # The warm writers other than the source take no part in any broadcast.
    for warm in (2, 4, 6):
        assert tally.ops[warm, "broadcast_bytes"] == 0
        assert tally.ops[warm, "split"] == 2  # the writers' split, then the audience's
    report = reports[0]
    assert all(r == report for r in reports)
    assert report.received_bytes == total and report.discarded_bytes == 0
    assert total <= report.broadcast_bytes < total + 16 * len(arts) + 16 * report.broadcasts
    assert report.objects_published == 20 and report.pool_hits == 0
    # Every rank: agree, the probe round (two), discover, writers' split, one move
    # heartbeat, move check, report.
    assert group.calls == [8] * 10


def test_sync_after_a_one_rank_warm_up_reaches_only_the_pools_that_lack_it() -> None:
    arts, blobs = make_blobs(5, low=1000, high=5000)
    size = {a.sha256: len(blobs[a.sha256]) for a in arts}
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    for a in arts:  # rank 3 warmed up lazily into node1's pool
        pools[3].put(blobs[a.sha256], a.sha256)
    pools[3].remember(arts)
    for a in arts[:2]:  # node2's pool already had two of them
        stores["node2"].objects[a.sha256] = blobs[a.sha256]
    group = group8()
    comms, tally = counted(group)
    reports = ok(run_ranks(group, lambda r: sync(comm=comms[r], pool=pools[r])))
    assert all(s.objects == blobs for s in stores.values())
    everything = sum(size.values())
    assert tally.payload[0] == tally.payload[6] == everything
    assert tally.payload[4] == sum(size[a.sha256] for a in arts[2:]), "only what node2 lacked"
    assert tally.payload[2] == 0, "the warm writer receives nothing"
    assert all(tally.payload[r] == 0 for r in (1, 3, 5, 7)), "non-writers move nothing"
    report = reports[0]
    assert report.received_bytes == 2 * everything + tally.payload[4]
    assert report.discarded_bytes == 0 and report.objects_published == 5 + 5 + 3


def test_cold_start_moves_bytes_over_the_writers_communicator_without_extra_splits() -> None:
    arts, blobs = make_blobs(16)
    origin = FakeOrigin(blobs)
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    group = group8()
    comms, tally = counted(group)
    reports = ok(
        run_ranks(
            group,
            lambda r: prefetch(
                arts, comm=comms[r], pool=pools[r], origin=origin, bucket_bytes=8000
            ),
        )
    )
    assert all(s.objects == blobs for s in stores.values())
    assert all(tally.ops[r, "split"] == 1 for r in range(8)), "the writers' split only"
    report = reports[0]
    assert report.discarded_bytes == 0
    assert report.received_bytes == sum(tally.payload.values()) == 3 * report.origin_bytes
    # Every writer takes every bucket; non-writers none.
    assert all(tally.ops[w, "broadcast_bytes"] == report.broadcasts for w in (0, 2, 4, 6))
    assert all(tally.ops[r, "broadcast_bytes"] == 0 for r in (1, 3, 5, 7))


def test_audiences_past_the_cap_still_fill_every_pool() -> None:
    arts, blobs = make_blobs(15, low=500, high=900)
    shas = [a.sha256 for a in arts]
    pools, stores = make_pools(6, lambda r: f"rank{r}")
    pairs = [(i, j) for i in range(6) for j in range(i + 1, 6)]  # 15 lack-sets of two pools
    for k, sha in enumerate(shas):
        for r in range(6):
            if r not in pairs[k]:
                stores[f"rank{r}"].objects[sha] = blobs[sha]
    have = {
        f"rank{r}": [sha in stores[f"rank{r}"].objects for sha in sorted(shas)] for r in range(6)
    }
    ids = [f"rank{r}" for r in range(6)]
    uncapped = make_plan(sorted(shas), [1] * 15, ids, ids, have, max_audiences=99)
    assert len(uncapped.audiences) > 8
    group = ThreadGroup(6, timeout=20)
    comms, tally = counted(group)
    origin = FakeOrigin(blobs)
    reports = ok(
        run_ranks(group, lambda r: prefetch(arts, comm=comms[r], pool=pools[r], origin=origin))
    )
    assert origin.total == 0
    assert all(s.objects == blobs for s in stores.values())
    # The writers' own communicator (the move's heartbeats use the job's), then at
    # most one per audience under the cap.
    assert all(tally.ops[r, "split"] <= 1 + 8 for r in range(6))
    report = reports[0]
    assert report.discarded_bytes > 0, "what is past the cap goes to every writer"
    assert report.received_bytes - report.discarded_bytes == 2 * sum(map(len, blobs.values()))


class ConcurrencyOrigin(FakeOrigin):
    """Records the most downloads that were in flight at once."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        super().__init__(blobs)
        self.now = 0
        self.most = 0

    def fetch(self, artifact: Artifact) -> bytes:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            threading.Event().wait(0.01)
            return super().fetch(artifact)
        finally:
            with self._lock:
                self.now -= 1


@pytest.mark.parametrize("per_job", [1, 3, 5, 12, 64])
def test_the_job_cap_bounds_concurrent_downloads_over_all_ranks(per_job: int) -> None:
    arts, blobs = make_blobs(40)
    origin = ConcurrencyOrigin(blobs)
    pools, stores = make_pools(8, LAYOUTS["node-local"])
    group = group8()
    reports = ok(run_ranks(group, lambda r: prefetch(
        arts, comm=group.comm(r), pool=pools[r], origin=origin, bucket_bytes=8000,
        downloads_per_rank=4, downloads_per_job=per_job)))
    assert origin.total == 40 and origin.most <= per_job
    # As few ranks as carry the job's connections at 4 each, at most the 8 ranks.
    downloaders = min(-(-per_job // 4), 8)
    assert len(reports[0].downloaders) == downloaders
    # The downloaders spread over the nodes.
    assert len({r // 2 for r in reports[0].downloaders}) == min(downloaders, 4)
    for store in stores.values():
        assert store.objects == blobs


def test_download_threads_share_the_job_cap() -> None:
    from distcache.collective._plan import download_threads

    plan = make_plan(["a" * 64, "b" * 64, "c" * 64], [1, 1, 1], ["p", "q", "r"],
                     ["n0", "n1", "n2"], {"p": [False] * 3, "q": [False] * 3,
                                           "r": [False] * 3})
    assert [download_threads(plan, r, 4, 5) for r in range(3)] == [2, 2, 1]
    assert [download_threads(plan, r, 1, 64) for r in range(3)] == [1, 1, 1]
    capped = make_plan(["a" * 64, "b" * 64], [1, 1], ["p", "q", "r"], ["n0", "n1", "n2"],
                       {"p": [False] * 2, "q": [False] * 2, "r": [False] * 2},
                       max_downloaders=1)
    assert list(capped.downloads) == [0]
    assert [download_threads(capped, r, 4, 1) for r in range(3)] == [1, 0, 0]


def test_a_journal_exchange_is_compact_and_round_trips() -> None:
    import pickle

    from distcache.collective._sync import decode_gained, encode_gained

    shas = [sha256_hex(str(i).encode()) for i in range(2000)]
    names = {f"cubins/family/kernel_{i:05d}_sm100f.cubin": s for i, s in enumerate(shas)}
    blob = encode_gained(shas, names)
    assert decode_gained(blob) == (shas, names)
    assert len(blob) < len(pickle.dumps((shas, names))) / 2
    assert decode_gained(encode_gained([], {})) == ([], {})


class TamperingComm(CountingComm):
    """A receiver's communicator, through every split: each bucket it receives passes
    through :meth:`tamper` first, as a faulty or hostile peer's bytes could differ."""

    def tamper(self, got: bytes) -> bytes:
        return got

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        got = self.inner.broadcast_bytes(data, root, timeout=timeout)
        return got if self.rank == root else self.tamper(got)

    def split(self, color: int) -> Communicator:
        return type(self)(self.inner.split(color), self.world_rank, self.tally)


class ForgingComm(TamperingComm):
    """Each bucket received names an object far beyond the plan."""

    def tamper(self, got: bytes) -> bytes:
        if len(got) < 21:
            return got
        forged = bytearray(got)
        forged[-21:-17] = (1 << 30).to_bytes(4, "little")  # the last entry's index
        return bytes(forged)


def sent_to_one(receiving: Any, *, bucket_bytes: int, timeout: float
                ) -> tuple[list[Artifact], dict[str, bytes], dict[str, Any], list[Any]]:
    """Rank 0 holds four artifacts and sends every one to rank 1, whose communicator is
    ``receiving(inner, 1, tally)``: the artifacts, their bytes, the pools' stores and
    each rank's report or error."""
    arts, blobs = make_blobs(4)
    pools, stores = make_pools(2, lambda r: f"rank{r}")
    stores["rank0"].objects.update(blobs)
    group = ThreadGroup(2, timeout=timeout)
    tally = Tally()
    comms = [CountingComm(group.comm(0), 0, tally), receiving(group.comm(1), 1, tally)]
    results = run_ranks(group, lambda r: prefetch(arts, comm=comms[r], pool=pools[r],
                                                  origin=None, bucket_bytes=bucket_bytes,
                                                  timeout=timeout))
    return arts, blobs, stores, results


def test_a_bucket_naming_an_object_beyond_the_plan_is_a_typed_error_on_every_rank() -> None:
    _, _, stores, results = sent_to_one(ForgingComm, bucket_bytes=8000, timeout=3)
    for result in results:
        assert isinstance(result, DistcacheError), result
    assert "malformed bucket" in str(results[1]) and "names object" in str(results[1])
    assert stores["rank1"].objects == {}


def test_agreed_list_takes_a_sorted_list_as_it_is_and_sorts_any_other() -> None:
    from distcache.collective._prefetch import _agreed_list

    a, b, c = (Artifact(n, s * 64) for n, s in (("a", "1"), ("b", "2"), ("c", "3")))
    b_sized = Artifact("b", "2" * 64, 7)
    assert _agreed_list([a, b, c]) == [a, b, c]
    assert _agreed_list(iter([c, a, b])) == [a, b, c]
    # A repeated pair is not strictly sorted: one entry is kept, the sized one.
    assert _agreed_list([a, b, b_sized, c]) == [a, b_sized, c]
    assert _agreed_list([a, b_sized, b, c]) == [a, b_sized, c]
    # Same name, two digests: both kept, in digest order.
    b_other = Artifact("b", "4" * 64)
    assert _agreed_list([a, b_other, b]) == [a, b, b_other]
    assert _agreed_list([]) == []

"""Setting up the origin's client ahead of the downloads (distcache._prepare): only on
a pool that lacks something, never raising, and the HTTP origin's set-up is the one
its first fetch would make."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from distcache._prepare import lacks_any, prepare_in_background, set_up_where_downloading
from distcache.artifact import Artifact
from distcache.origins import HttpOrigin, OriginChain
from distcache.store import ArtifactPool


class _Counting:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def prepare(self) -> None:
        self.calls += 1
        if self.fail:
            raise OSError("no route to the origin")


def _manifest(tmp_path: Path, pool: ArtifactPool, held: bool) -> Path:
    data = b"kernel bytes"
    sha = pool.put(data) if held else hashlib.sha256(data).hexdigest()
    path = tmp_path / "m.txt"
    path.write_text(f"{sha}  k.cubin\n")
    return path


def test_only_a_pool_that_lacks_something_sets_up_the_origin(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    warm = _manifest(tmp_path, pool, held=True)
    origin = _Counting()
    assert not lacks_any(pool, [warm], [])
    assert prepare_in_background(origin, pool, [warm], []) is None  # type: ignore[arg-type]
    assert origin.calls == 0
    missing = Artifact("other.cubin", "b" * 64)
    assert lacks_any(pool, [warm, [missing]], [])
    thread = prepare_in_background(origin, pool, [warm, [missing]], [])  # type: ignore[arg-type]
    assert thread is not None
    thread.join(30)
    assert origin.calls == 1


def test_an_unreadable_manifest_or_an_integration_counts_as_lacking(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    assert lacks_any(pool, [tmp_path / "absent.txt"], [])
    assert lacks_any(pool, [], [object()])  # type: ignore[list-item]
    assert not lacks_any(pool, [], [])


def test_a_failing_set_up_never_raises(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    origin = _Counting(fail=True)
    thread = prepare_in_background(origin, pool, [[Artifact("x", "c" * 64)]], [])  # type: ignore[arg-type]
    assert thread is not None
    thread.join(30)
    assert origin.calls == 1 and not thread.is_alive()
    assert prepare_in_background(None, pool, [[Artifact("x", "c" * 64)]], []) is None


def test_the_http_origin_builds_its_session_once(tmp_path: Path) -> None:
    origin = HttpOrigin("http://127.0.0.1:9")  # nothing is sent: set-up only
    assert origin._session is None
    origin.prepare()
    session = origin._session
    assert session is not None
    origin.prepare()
    assert origin._session is session  # idempotent
    chain = OriginChain([HttpOrigin("http://127.0.0.1:9"), origin])
    chain.prepare()
    first = chain.origins[0]
    assert isinstance(first, HttpOrigin) and first._session is not None


def test_a_warm_pool_is_looked_up_a_sample_at_a_time(tmp_path: Path) -> None:
    from distcache import _prepare

    pool = ArtifactPool(tmp_path / "pool")
    shas = [pool.put(f"kernel {i}".encode()) for i in range(200)]
    manifest = tmp_path / "m.txt"
    manifest.write_text("# the family\n\n" + "".join(f"{s}  k{i}.cubin\n" for i, s in enumerate(shas)))
    looked: list[str] = []
    holding = pool.holding

    def counted(wanted: object) -> list[bool]:
        listed = list(wanted)  # type: ignore[call-overload]
        looked.extend(listed)
        return holding(listed)

    pool.holding = counted  # type: ignore[method-assign]
    assert not lacks_any(pool, [manifest], [])
    assert len(looked) == _prepare.SAMPLE and shas[0] in looked and shas[-1] in looked
    # The last entry lacking is seen; a malformed line counts as lacking.
    manifest.write_text(manifest.read_text() + f"{'d' * 64}  late.cubin\n")
    assert lacks_any(pool, [manifest], [])
    manifest.write_text("not a digest line\n")
    assert lacks_any(pool, [manifest], [])


def test_the_set_up_runs_where_a_download_may_follow(tmp_path: Path) -> None:
    from distcache.comm import local

    pool = ArtifactPool(tmp_path / "pool")
    cold = [[Artifact("x", "d" * 64)]]
    origin = _Counting()
    comm = local()
    # No origin, nothing listed or wanted, downloads off: nothing is set up.
    assert set_up_where_downloading(comm, pool, None, cold, [], None, 10) is None
    assert set_up_where_downloading(comm, pool, origin, [], [], None, 10) is None  # type: ignore[arg-type]
    assert set_up_where_downloading(comm, pool, origin, cold, [], True, 10) is None  # type: ignore[arg-type]
    assert origin.calls == 0
    # A single rank downloads for itself: its client is set up.
    thread = set_up_where_downloading(comm, pool, origin, cold, [], False, 10)  # type: ignore[arg-type]
    assert thread is not None
    thread.join(30)
    assert origin.calls == 1


def test_only_the_leaders_the_plan_may_give_downloads_to_set_up_their_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache._prepare import leader_downloaders
    from distcache.collective._plan import make_plan
    from distcache.comm import Communicator, NodeTree, ThreadGroup
    from tests.unit.test_comm_local import run_ranks

    # 6 nodes of 2 ranks; 4 connections for the job at 2 per rank: a leader takes 2
    # (its share of the job's is less), so the job's 4 are carried by 2 leaders.
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_RANK", "2")
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "4")
    group = ThreadGroup(12, [f"n{r // 2}" for r in range(12)])
    pools = [ArtifactPool(tmp_path / f"pool{n}") for n in range(6)]
    cold = [[Artifact(f"k{i}.cubin", hashlib.sha256(b"%d" % i).hexdigest()) for i in range(12)]]
    origins: list[_Counting] = []

    def set_up(comm: Communicator) -> bool:
        thread = set_up_where_downloading(NodeTree(comm), pools[comm.rank // 2],
                                          origins[comm.rank],  # type: ignore[arg-type]
                                          cold, [], False, 10)
        if thread is not None:
            thread.join(30)
        return thread is not None

    origins[:] = [_Counting() for _ in range(12)]
    assert run_ranks(group, set_up) == [r in (0, 2) for r in range(12)]
    assert [o.calls for o in origins] == [1 if r in (0, 2) else 0 for r in range(12)]
    places = run_ranks(group, lambda c: (NodeTree(c).node_index, leader_downloaders(NodeTree(c))))
    assert places == [(r // 2, 2) for r in range(12)]
    # The leaders' plan over the 6 leaders (one per node, in node order) gives every
    # download to those two.
    plan = make_plan([a.sha256 for a in cold[0]], [None] * 12, [f"p{n}" for n in range(6)],
                     [f"n{n}" for n in range(6)], {f"p{n}": [False] * 12 for n in range(6)},
                     max_downloaders=2)
    assert sorted(plan.downloads) == [0, 1]

    # A download count the settings cannot read: every leader sets up, and none
    # raises before the collectives that follow (the members would wait in them).
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "many")
    origins[:] = [_Counting() for _ in range(12)]
    assert run_ranks(group, set_up) == [r % 2 == 0 for r in range(12)]

"""A download worker that an origin ends with something other than an ``Exception``
(an origin or library calling ``sys.exit``, an interrupt raised inside it) still
settles its artifact: the downloads end at once with that failure, on every rank alike,
instead of leaving the job to wait out the timeout and call it a stalling origin."""

from __future__ import annotations

import time

import pytest

from distcache.artifact import Artifact
from distcache.collective import prefetch
from distcache.collective._download import Downloads, Pending, download_objects
from distcache.comm import ThreadGroup
from distcache.errors import PrefetchError
from tests.unit.test_prefetch import FakeOrigin, FakePool, Store, make_blobs, run_ranks

pytestmark = pytest.mark.timeout(120)


class DyingOrigin(FakeOrigin):
    """Raises ``kind`` for ``bad``; serves everything else."""

    def __init__(self, blobs: dict[str, bytes], bad: str, kind: type[BaseException]) -> None:
        super().__init__(blobs)
        self.bad, self.kind = bad, kind

    def fetch(self, artifact: Artifact) -> bytes:
        if artifact.name == self.bad:
            with self._lock:
                self.requests[artifact.name] += 1
            raise self.kind("the origin's library gave up")
        return super().fetch(artifact)


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_worker_ended_by_a_base_exception_ends_the_downloads_with_it(
        kind: type[BaseException]) -> None:
    arts, blobs = make_blobs(4)
    origin = DyingOrigin(blobs, arts[0].name, kind)
    started = time.monotonic()
    got = download_objects(FakePool(Store("p")), origin, arts, workers=1, timeout=6)
    elapsed = time.monotonic() - started
    assert elapsed < 3, f"waited {elapsed:.1f} s for a worker that was gone"
    assert got.failure is not None and got.failure[0] == arts[0].name
    assert type(got.failure[1]) is kind
    # Not one artifact's failure: nothing more is asked of the origin.
    assert origin.total == 1 and got.downloads == 0


def test_a_dead_worker_settles_its_artifact_and_leaves_nothing_running() -> None:
    arts, blobs = make_blobs(3)
    pending = Pending(a.sha256 for a in arts)
    job = Downloads(FakePool(Store("p")), DyingOrigin(blobs, arts[1].name, SystemExit),
                    arts, workers=1, pending=pending).start()
    assert job.wait(5)
    assert job.running() == [] and not pending.waiting(arts[1].sha256)
    assert type(job.result().failure[1]) is SystemExit  # type: ignore[index]


def test_a_base_exception_on_one_rank_fails_every_rank_alike_and_soon() -> None:
    arts, blobs = make_blobs(8)
    bad = arts[3].name
    group = ThreadGroup(2, ["a", "b"], timeout=6)
    pools = [FakePool(Store("p0")), FakePool(Store("p1"))]
    origin = DyingOrigin(blobs, bad, SystemExit)
    started = time.monotonic()
    out = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                              origin=origin, timeout=6), join=60)
    elapsed = time.monotonic() - started
    assert all(isinstance(e, PrefetchError) for e in out), out
    assert len({str(e) for e in out}) == 1
    assert out[0].artifact == bad and "SystemExit" in out[0].cause, out[0]
    assert "stalling" not in str(out[0])
    assert elapsed < 4, f"took {elapsed:.1f} s"

"""What the public collectives tell the other ranks when this one fails on its own
(distcache.prefetch and distcache.sync called directly, not through init): a bad
setting read before their first round, and a failure inside them; and what they never
tell: a failure raised from the transport's (a timeout every rank meets for itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distcache.collective import prefetch, sync
from distcache.collective._run import Run
from distcache.comm._announce import to_announce
from distcache.errors import (
    CollectiveTimeout,
    CommError,
    ConfigError,
    PoolError,
    PrefetchError,
)
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts


class Telling:
    """A communicator of two ranks as far as telling goes: records what it is told."""

    rank, size, node_id = 0, 2, "node0"

    def __init__(self) -> None:
        self.told: list[BaseException] = []

    def announce(self, error: BaseException) -> bool:
        self.told.append(error)
        return True

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        raise AssertionError("a round began before the failure was told")


def _guarded(body: Any) -> tuple[BaseException, list[BaseException]]:
    comm = Telling()
    run = Run("prefetch", comm, None, 5.0)  # type: ignore[arg-type]
    with pytest.raises(BaseException) as raised:
        run.guarded(body)
    return raised.value, comm.told


def test_a_failure_raised_from_a_timeout_is_not_told() -> None:
    def body() -> None:
        raise CollectiveTimeout("allgather timed out", op="allgather")

    error, told = _guarded(body)
    assert type(error) is PrefetchError and error.rank == 0 and not error.agreed
    assert isinstance(error.__cause__, CollectiveTimeout)
    assert told == []
    # Nor by init, which tells what the prefetch raised: the cause decides.
    assert not to_announce(error, 0)


def test_a_failure_raised_from_a_transport_failure_is_not_told() -> None:
    def body() -> None:
        raise CommError("peer went away", op="broadcast", backend="mpi")

    error, told = _guarded(body)
    assert type(error) is PrefetchError and told == []
    assert not to_announce(error, 0)


def test_a_ranks_own_failure_inside_the_collective_is_told() -> None:
    failure = PoolError("cannot write the object: No space left on device")

    def body() -> None:
        raise failure

    error, told = _guarded(body)
    assert error is failure and told == [failure]


def test_an_agreed_failure_is_not_told() -> None:
    agreed = PrefetchError("rank 1 failed to fetch x", artifact="x", rank=1, host="n1",
                           cause="OriginError: 404", phase="fetch")
    agreed.agreed = True

    def body() -> None:
        raise agreed

    error, told = _guarded(body)
    assert error is agreed and told == []


@pytest.mark.parametrize("call", ["prefetch", "sync"])
def test_a_bad_setting_is_told_before_the_first_round(
        call: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = Telling()
    pool = ArtifactPool(tmp_path / "pool")
    artifacts = make_artifacts(tmp_path / "origin", 2)
    monkeypatch.setenv("DISTCACHE_BUCKET_BYTES", "lots")  # on this rank alone
    with pytest.raises(ConfigError, match="DISTCACHE_BUCKET_BYTES") as raised:
        if call == "prefetch":
            prefetch(artifacts, comm=comm, pool=pool,  # type: ignore[arg-type]
                     origin=DirOrigin(tmp_path / "origin"))
        else:
            sync(comm=comm, pool=pool)  # type: ignore[arg-type]
    assert comm.told == [raised.value]

"""distcache.init under mpirun -n 4 with one rank failing on its own: its pool cannot be
made there. Every other rank raises that rank's failure at once, named, instead of
waiting out the timeout and raising a timeout that cannot say why."""

from __future__ import annotations

from pathlib import Path

import pytest

import distcache
from distcache.comm import from_mpi
from distcache.comm._base import Communicator
from distcache.errors import CollectiveTimeout, CommError, PoolError

#: Far longer than a word takes: a rank still waiting when it runs out raises a
#: CollectiveTimeout, which the tests refuse.
TIMEOUT_S = 120.0


def _init_with_one_bad_pool(comm: Communicator, shared_tmp: Path, bad: int) -> BaseException:
    blocker = shared_tmp / f"not-a-directory-{bad}"
    if comm.rank == bad:
        blocker.write_text("a file where a directory should be")
        pool = blocker / "pool"
    else:
        pool = shared_tmp / f"pools-{bad}" / f"node{comm.rank // 2}"
    # The communicator init makes over MPI, whichever backend the suite's runs on.
    own = from_mpi(node_id=f"node{comm.rank // 2}", timeout=TIMEOUT_S)
    try:
        distcache.init(comm=own, pool=pool, manifests=[], integrations=(),
                       timeout=TIMEOUT_S)
    except Exception as exc:
        # Its collectives stopped for ever: the communicator is retired, on every rank.
        with pytest.raises(CommError, match=f"unusable after .*rank {bad}/{comm.size} .*failed"):
            own.barrier(timeout=5)
        return exc
    finally:
        own.close()
    pytest.fail(f"rank {comm.rank}: init succeeded beside a rank whose pool cannot be made")


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("bad", [2, 0])
def test_a_ranks_own_set_up_failure_stops_every_rank_at_once_with_its_cause(
    comm: Communicator, shared_tmp: Path, bad: int
) -> None:
    comm.barrier()
    error = _init_with_one_bad_pool(comm, shared_tmp, bad)
    assert not isinstance(error, CollectiveTimeout), error
    assert type(error) is PoolError, repr(error)
    assert "cannot create pool root" in str(error) and "Not a directory" in str(error)
    if comm.rank == bad:
        assert not error.agreed  # its own, printed where it happened
    else:
        assert str(error).startswith(
            f"rank {bad}/{comm.size} (node{bad // 2}) failed, so rank {comm.rank} stops: ")
        assert error.rank == bad and error.host == f"node{bad // 2}" and error.agreed
    # Every rank left init: the suite's own communicator still works for all of them.
    assert comm.allgather_object(type(error).__name__) == ["PoolError"] * comm.size


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("call", ["prefetch", "sync"])
def test_a_bad_setting_on_one_rank_stops_a_direct_collective_at_once(
    comm: Communicator, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """distcache.prefetch and distcache.sync called directly (not through init), with
    a setting only rank 1 cannot read: every rank raises its ConfigError."""
    from distcache.errors import ConfigError
    from distcache.origins import DirOrigin
    from distcache.store import ArtifactPool
    from distcache.testing import make_artifacts

    bad = 1
    origin = shared_tmp / f"origin-{call}-{comm.rank}"
    artifacts = make_artifacts(origin, 3, seed=7)  # the same on every rank
    pool = ArtifactPool(shared_tmp / f"pools-{call}" / f"node{comm.rank // 2}")
    own = from_mpi(node_id=f"node{comm.rank // 2}", timeout=TIMEOUT_S)
    comm.barrier()
    if comm.rank == bad:
        monkeypatch.setenv("DISTCACHE_BUCKET_BYTES", "lots")
    try:
        with pytest.raises(ConfigError) as raised:
            if call == "prefetch":
                distcache.prefetch(artifacts, comm=own, pool=pool, origin=DirOrigin(origin),
                                   timeout=TIMEOUT_S)
            else:
                distcache.sync(comm=own, pool=pool, timeout=TIMEOUT_S)
    finally:
        monkeypatch.delenv("DISTCACHE_BUCKET_BYTES", raising=False)
        own.close()
    error = raised.value
    assert "DISTCACHE_BUCKET_BYTES='lots'" in str(error)
    if comm.rank == bad:
        assert not error.agreed
    else:
        assert str(error).startswith(f"rank {bad}/{comm.size} (node{bad // 2}) failed, "
                                     f"so rank {comm.rank} stops: ")
        assert error.rank == bad and error.agreed
    assert comm.allgather_object(type(error).__name__) == ["ConfigError"] * comm.size

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

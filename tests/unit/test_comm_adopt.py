"""comm.adopt: the one choice of communicator, tested as the pure policy it is, and the
run scope every adoption agrees on."""

from __future__ import annotations

import os
import pickle
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from distcache.comm import adopt
from distcache.comm._local import LocalCommunicator
from distcache.comm._scope import job_root, meet
from distcache.comm.adopt import Adopted, choose
from distcache.errors import CollectiveTimeout, CommError
from launch import detect

OPENMPI_4 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
OPENMPI_1 = {
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}
TORCHRUN_2 = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture(autouse=True)
def _no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    # The policy looks at sys.modules: neither torch nor mpi4py is "already up" here.
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)


def test_a_multi_rank_mpi_launch_uses_a_duplicate_of_the_mpi_world() -> None:
    assert choose(detect(OPENMPI_4)) == "mpi"


def test_a_world_of_one_starts_no_runtime() -> None:
    assert choose(detect({})) == "local"
    assert choose(detect(OPENMPI_1)) == "local"


def test_an_already_imported_mpi4py_is_used_by_a_single_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    assert choose(detect({})) == "mpi"
    # Under torchrun the MPI singleton is not the job's world.
    assert choose(detect(TORCHRUN_2)) == "gloo"


def test_torchrun_gets_a_private_gloo_group_whether_or_not_the_engine_made_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert choose(detect(TORCHRUN_2)) == "gloo"

    class _Dist:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def is_initialized() -> bool:
            return True

    class _Torch:
        distributed = _Dist

    monkeypatch.setitem(sys.modules, "torch", _Torch)
    # The engine's default group exists: still distcache's own group, never that one.
    assert choose(detect(TORCHRUN_2)) == "gloo"
    assert choose(detect({})) == "gloo"


def test_adopt_alone_gives_a_local_communicator() -> None:
    adopted = adopt(environ={}, node_id="n7")
    assert isinstance(adopted, Adopted)
    assert isinstance(adopted.comm, LocalCommunicator)
    assert (adopted.choice, adopted.rendezvous, adopted.comm.node_id) == ("local", "", "n7")
    adopted.close()
    adopted.close()


def test_adopt_rejects_unknown_options() -> None:
    with pytest.raises(TypeError, match="unknown option"):
        adopt(environ={}, colour="blue")


def test_every_adoption_has_a_scope_whose_secret_is_never_shown() -> None:
    first, second = adopt(environ={}), adopt(environ={})
    for scope in (first.scope, second.scope):
        assert re.fullmatch(r"[0-9a-f]{32}", scope.nonce) and len(scope.secret) == 32
        assert scope.secret.hex() not in repr(scope) and "secret" not in repr(scope)
        assert scope.prefix.startswith("distcache/") and scope.prefix.endswith(scope.nonce)
    assert first.scope.nonce != second.scope.nonce
    assert first.scope.secret != second.scope.secret


def test_the_scope_names_the_launchers_job_and_attempt() -> None:
    env = {**TORCHRUN_2, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "3"}
    scope = adopt(environ=env).scope
    assert (scope.job, scope.attempt) == ("torchrun:job-a", 3)
    assert scope.prefix == f"{job_root('torchrun:job-a', 3)}/{scope.nonce}"
    # Jobs and attempts never share a prefix.
    roots = {job_root(job, attempt) for job in ("a", "b", "") for attempt in (0, 1)}
    assert len(roots) == 6


# -- agreeing on a nonce over a store shared with other adoptions ---------------------


class _Store:
    """The part of a ``torch.distributed.Store`` that :func:`meet` uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self._changed:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
                self._changed.notify_all()
                return desired.encode()
            return expected.encode() if current is None else current

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self.data for k in keys),
                                          timeout.total_seconds()):
                raise RuntimeError(f"wait timeout after {timeout}, keys: {keys}")

    def get(self, key: str) -> bytes:
        return self.data[key]


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def _ranks(store: _Store, adoptions: list[tuple[int, float, str, int]],
           size: int = 2) -> list[Any]:
    """Run ``(rank, delay, job, attempt)`` adoptions at once on threads, each with 5 s;
    each gives its nonce or the error it raised."""
    def one(rank: int, delay: float, job: str, attempt: int) -> Any:
        time.sleep(delay)
        try:
            return meet(store, rank, size, job, attempt, _soon())
        except CommError as exc:
            return exc

    with ThreadPoolExecutor(len(adoptions)) as pool:
        return list(pool.map(lambda a: one(*a), adoptions))


def test_each_ranks_nth_adoption_meets_the_others_nth_however_late_it_comes() -> None:
    store = _Store()
    # Three adoptions in a row (the wrapper, then two inits); rank 1 comes late each time.
    for _ in range(3):
        zero, one = _ranks(store, [(0, 0.0, "torchrun:j", 0), (1, 0.3, "torchrun:j", 0)])
        assert isinstance(zero, str) and zero == one
    counts = {k: v for k, v in store.data.items() if "adoptions" in k}
    assert sorted(counts.values()) == [b"3", b"3"]


def test_a_new_attempt_or_another_job_never_reads_an_earlier_nonce() -> None:
    store = _Store()
    old, same = _ranks(store, [(0, 0.0, "torchrun:j", 0), (1, 0.0, "torchrun:j", 0)])
    assert old == same
    start = time.monotonic()
    for job, attempt in (("torchrun:j", 1), ("torchrun:other", 0)):
        with pytest.raises(CollectiveTimeout, match="rank 0 did not open"):
            meet(store, 1, 2, job, attempt, time.monotonic() + 0.3)
    assert time.monotonic() - start < 5.0  # each wait ends at its deadline
    # A restart (attempt 2) meets afresh.
    fresh_nonce, again = _ranks(store, [(0, 0.0, "torchrun:j", 2), (1, 0.0, "torchrun:j", 2)])
    assert fresh_nonce == again != old


def test_a_rank_that_comes_after_its_peer_gave_up_learns_so_at_once() -> None:
    store = _Store()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"this rank gave up.*1 of 2 ranks"):
        meet(store, 0, 2, "j", 0, time.monotonic() + 0.3)
    late = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="another rank gave up"):
        meet(store, 1, 2, "j", 0, _soon())
    assert time.monotonic() - late < 1.0 and late - start < 3.0


def test_a_store_value_that_is_not_a_nonce_is_refused_never_unpickled() -> None:
    class Boom:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("touch /nonexistent/should-never-run",))

    store = _Store()
    where = f"{job_root('j', 0)}/1/nonce"
    store.data[where] = pickle.dumps(Boom())
    with pytest.raises(CommError, match="not a nonce"):
        meet(store, 1, 2, "j", 0, _soon())
    # Rank 0 finding its meeting already claimed refuses too.
    store.data[where] = b"0" * 32
    with pytest.raises(CommError, match="already claimed"):
        meet(store, 0, 2, "j", 0, _soon())
    # And a meeting state that is not distcache's.
    store.data[f"{job_root('j', 0)}/2/state"] = b"\x80\x04junk"
    with pytest.raises(CommError, match="not distcache's meeting state"):
        meet(store, 0, 1, "j", 0, _soon())


def test_ranks_meeting_at_once_on_threads_agree() -> None:
    store = _Store()
    for _ in range(3):
        got = _ranks(store, [(r, 0.0, "j", 0) for r in range(4)], size=4)
        assert len(set(got)) == 1 and isinstance(got[0], str)

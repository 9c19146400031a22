"""The in-process communicators, the shared seam helpers, and backend selection.

The thread-rank checks mirror tests/mpi/test_comm.py so that policy tested against a
ThreadGroup means the same thing on MPI and torch.distributed. The world-size-1 runs
of the MPI and torch backends happen in child processes: ``MPI_Init`` and a torch
process group are process-wide state.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from distcache import errors
from distcache.comm import (
    Communicator,
    LocalCommunicator,
    ThreadGroup,
    agree_on_error,
    local,
)
from distcache.comm._base import MAX_MESSAGE_BYTES, chunk_spans
from distcache.comm.adopt import launcher_is_mpi
from distcache.errors import (
    CollectiveTimeout,
    ConfigError,
    IntegrityError,
    RemoteError,
    WireError,
)
from tests.support.helpers import run_group
from tests.support.threads import run_ranks

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


# -- chunking ---------------------------------------------------------------------------


def test_three_gib_in_one_gib_chunks_is_three_full_spans() -> None:
    assert list(chunk_spans(3 * GiB, GiB)) == [(0, GiB), (GiB, 2 * GiB), (2 * GiB, 3 * GiB)]


def test_three_gib_plus_one_byte_adds_a_one_byte_tail() -> None:
    spans = list(chunk_spans(3 * GiB + 1, GiB))
    assert len(spans) == 4
    assert spans[-1] == (3 * GiB, 3 * GiB + 1)


def test_default_chunk_keeps_every_message_under_two_gib() -> None:
    spans = list(chunk_spans(5 * GiB, MAX_MESSAGE_BYTES))
    assert all(stop - start <= MAX_MESSAGE_BYTES < 2 * GiB for start, stop in spans)
    assert spans[0][0] == 0 and spans[-1][1] == 5 * GiB
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_empty_payload_has_no_spans_and_bad_chunk_is_rejected() -> None:
    assert list(chunk_spans(0, GiB)) == []
    with pytest.raises(ValueError, match="chunk size"):
        list(chunk_spans(10, 0))


# -- LocalCommunicator ------------------------------------------------------------------


def test_local_communicator_is_a_world_of_one() -> None:
    comm = local("node-x")
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.size, comm.node_id, comm.backend) == (0, 1, "node-x", "local")
    assert comm.broadcast_bytes(b"abc", 0) == b"abc"
    assert comm.broadcast_bytes(b"", 0) == b""
    assert comm.allgather_object({"a": 1}) == [{"a": 1}]
    comm.barrier(timeout=0.01)
    child = comm.split(7)
    assert (child.size, child.node_id) == (1, "node-x")


def test_local_communicator_rejects_bad_root_and_missing_data() -> None:
    comm = LocalCommunicator()
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast_bytes(b"x", 1)
    with pytest.raises(ValueError, match="must pass data"):
        comm.broadcast_bytes(None, 0)


def test_agree_on_error_at_world_size_one_reraises_the_error_itself() -> None:
    comm = local()
    agree_on_error(comm, None)
    error = KeyError("k")
    with pytest.raises(KeyError) as info:
        agree_on_error(comm, error)
    assert info.value is error


# -- ThreadGroup: the MPI suite's assertions at world size 4 -------------------------------


def test_thread_broadcast_delivers_root_bytes_from_every_root() -> None:
    group = ThreadGroup(4)

    def body(comm: Communicator) -> list[bytes]:
        return [
            comm.broadcast_bytes(bytes([root]) * 100 if comm.rank == root else None, root)
            for root in range(comm.size)
        ]

    for got in run_ranks(group, body):
        assert got == [bytes([root]) * 100 for root in range(4)]


def test_thread_broadcast_of_empty_payload_returns_empty_bytes() -> None:
    results = run_ranks(
        ThreadGroup(3), lambda c: c.broadcast_bytes(b"" if c.rank == 0 else None, 0)
    )
    assert results == [b"", b"", b""]


def test_thread_allgather_object_returns_objects_in_rank_order() -> None:
    results = run_ranks(ThreadGroup(4), lambda c: c.allgather_object({"rank": c.rank}))
    assert all(r == [{"rank": i} for i in range(4)] for r in results)


def test_thread_split_by_parity_renumbers_ranks_within_each_half() -> None:
    def body(comm: Communicator) -> tuple[int, int, list[int]]:
        sub = comm.split(comm.rank % 2)
        return sub.rank, sub.size, sub.allgather_object(comm.rank)

    results = run_ranks(ThreadGroup(4), body)
    assert results == [(0, 2, [0, 2]), (0, 2, [1, 3]), (1, 2, [0, 2]), (1, 2, [1, 3])]


def test_thread_split_by_node_gives_each_node_its_ranks() -> None:
    group = ThreadGroup(4, node_ids=["a", "a", "b", "b"])

    def body(comm: Communicator) -> tuple[int, list[str]]:
        sub = comm.split(0 if comm.node_id == "a" else 1)
        return sub.size, sub.allgather_object(sub.node_id)

    assert run_ranks(group, body) == [(2, ["a", "a"])] * 2 + [(2, ["b", "b"])] * 2


def test_thread_rank_that_never_arrives_makes_the_others_time_out() -> None:
    group = ThreadGroup(4, timeout=30)

    def body(comm: Communicator) -> None:
        if comm.rank != 3:
            comm.barrier(timeout=0.2)

    results = run_ranks(group, body)
    assert results[3] is None
    for rank, exc in enumerate(results[:3]):
        assert isinstance(exc, CollectiveTimeout) and isinstance(exc, TimeoutError)
        assert (exc.op, exc.timeout, exc.rank) == ("barrier", 0.2, rank)  # type: ignore[attr-defined]
    assert group.calls == [1, 1, 1, 0]


def test_thread_error_on_one_rank_is_raised_on_every_rank() -> None:
    def body(comm: Communicator) -> None:
        error = IntegrityError("bad bytes", sha256="ab" * 32) if comm.rank == 2 else None
        agree_on_error(comm, error)

    results = run_ranks(ThreadGroup(4), body)
    assert all(isinstance(r, IntegrityError) and r.sha256 == "ab" * 32 for r in results)  # type: ignore[attr-defined]


def test_thread_errors_alike_on_every_rank_are_agreed_so_one_rank_reports() -> None:
    def body(comm: Communicator) -> None:
        agree_on_error(comm, ConfigError("cannot read manifest m", variable="manifest"))

    results = run_ranks(ThreadGroup(3), body)
    assert all(isinstance(r, ConfigError) and r.agreed for r in results)


@pytest.mark.parametrize("texts", [("a", "a", None), ("a", "b", "a")])
def test_thread_errors_not_alike_everywhere_are_not_agreed(texts: tuple[str | None, ...]
                                                           ) -> None:
    def body(comm: Communicator) -> None:
        text = texts[comm.rank]
        agree_on_error(comm, None if text is None else ConfigError(text))

    results = run_ranks(ThreadGroup(3), body)
    assert all(isinstance(r, ConfigError) and not r.agreed for r in results)


def test_thread_foreign_error_reaches_the_others_as_remote_error() -> None:
    group = ThreadGroup(3, node_ids=["h0", "h1", "h2"])

    def body(comm: Communicator) -> None:
        agree_on_error(comm, OSError("disk full") if comm.rank == 1 else None)

    results = run_ranks(group, body)
    assert isinstance(results[1], OSError)
    for other in (results[0], results[2]):
        assert isinstance(other, RemoteError)
        assert (other.rank, other.host, other.remote_type) == (1, "h1", "OSError")  # type: ignore[attr-defined]
        assert "rank 1/3 on h1 failed with OSError: disk full" in str(other)


# -- what crosses between thread-ranks: plain data, never code ------------------------------


class _Marker:
    """Unpickling this creates ``path``: proof that a payload's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_pickle_injected_where_an_allgather_reads_is_refused_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    evil = pickle.dumps({"rank": _Marker(marker)})
    exchange = ThreadGroup._exchange

    def forged(self: ThreadGroup, rank: int, obj: Any, op: str, timeout: float | None) -> Any:
        # Rank 1's transport carries a pickle instead of what rank 1 encoded.
        return exchange(self, rank, evil if rank == 1 and op == "allgather_object" else obj,
                        op, timeout)

    monkeypatch.setattr(ThreadGroup, "_exchange", forged)
    group = ThreadGroup(3, node_ids=["h0", "h1", "h2"])
    results = run_ranks(group, lambda c: c.allgather_object({"rank": c.rank}))
    for rank, err in enumerate(results):
        assert isinstance(err, WireError), err
        assert (err.peer, err.rank, err.op) == (1, rank, "allgather_object")  # type: ignore[attr-defined]
        assert "from rank 1" in str(err) and "a pickle?" in str(err)
    assert not marker.exists()
    # The same bytes, unpickled, would have run the object's code.
    pickle.loads(evil)
    assert marker.exists()


def test_a_value_that_is_not_plain_data_is_refused_before_any_rank_communicates() -> None:
    @dataclasses.dataclass
    class Report:
        count: int

    group = ThreadGroup(2)
    results = run_ranks(group, lambda c: c.allgather_object([Report(c.rank)]))
    assert all(isinstance(r, WireError) and "Report at [0]" in str(r) for r in results)
    assert group.calls == [0, 0]
    with pytest.raises(WireError, match="set"):
        local().allgather_object({1, 2})  # at world size 1 as well


def test_every_distcache_error_crosses_ranks_as_itself_with_its_attributes() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]

    def body(comm: Communicator) -> list[BaseException]:
        seen = []
        for cls in classes:
            values = {name: f"{name}-value" for name in cls.declared()}
            error = cls(f"{cls.__name__} on rank 1", **values) if comm.rank == 1 else None
            try:
                agree_on_error(comm, error)
            except BaseException as exc:
                seen.append(exc)
        return seen

    results = run_ranks(ThreadGroup(2), body)
    for cls, got in zip(classes, results[0], strict=True):
        assert type(got) is cls
        assert str(got) == f"{cls.__name__} on rank 1"
        assert {n: getattr(got, n) for n in cls.declared()} == {
            n: f"{n}-value" for n in cls.declared()}


def test_an_error_attribute_that_is_not_plain_data_arrives_as_text() -> None:
    class FromAnEngine(IntegrityError):
        pass

    def body(comm: Communicator) -> None:
        error = None
        if comm.rank == 1:
            error = FromAnEngine("bad bytes", sha256="ab" * 32, source=Path("/dev/null"),
                                 name=ValueError("inner"))
        agree_on_error(comm, error)

    other, own = run_ranks(ThreadGroup(2), body)
    assert type(own) is FromAnEngine
    # The nearest class of distcache's tree is rebuilt; no class of the sender's own.
    assert type(other) is IntegrityError
    assert (other.sha256, other.source, other.name) == ("ab" * 32, "/dev/null", "inner")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "forged",
    [
        ("KeyError", "x", "os.system", {}),  # not a class of distcache's tree
        ("KeyError", "x", "Exception", {}),
        ("KeyError", 3, None, {}),
        "rm -rf /",
    ],
)
def test_a_forged_error_description_is_a_wire_error_naming_the_peer(forged: Any) -> None:
    def body(comm: Communicator) -> None:
        if comm.rank == 1:  # speaks the protocol of agree_on_error with a forged entry
            comm.allgather_object((comm.node_id, forged, None))
        else:
            agree_on_error(comm, None)

    err, _ = run_ranks(ThreadGroup(2), body)
    assert isinstance(err, WireError), err
    assert (err.peer, err.op) == (1, "agree_on_error")  # type: ignore[attr-defined]


# -- backend selection --------------------------------------------------------------------


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in __import__("os").environ.items() if not _is_launcher_var(k)}
    clean["PYTHONPATH"] = str(ROOT)
    clean.update(env or {})
    return run_group(
        [sys.executable, "-c", textwrap.dedent(code)], timeout=120, env=clean, cwd=ROOT
    )


def _is_launcher_var(name: str) -> bool:
    prefixes = ("OMPI_", "PMI", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_")
    exact = {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "DISTCACHE_NODE_ID",
    }
    return name.startswith(prefixes) or name in exact


def test_importing_comm_imports_neither_torch_nor_mpi4py() -> None:
    proc = _python(
        """
        import sys
        import distcache.comm, distcache.comm.adopt, distcache.comm._mpi, distcache.comm._torch
        comm = distcache.comm.auto(node_id="n1")
        assert comm.backend == "local" and comm.node_id == "n1", comm
        leaked = sorted(m for m in ("torch", "mpi4py", "mpi4py.MPI") if m in sys.modules)
        assert not leaked, leaked
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_start_up_loads_neither_the_move_nor_the_sync_nor_what_it_does_not_use() -> None:
    # What a warm start never runs loads with its first use: the download and move
    # steps, the sync, FlashInfer's family warm-up, json (structured events only).
    proc = _python(
        """
        import sys
        import distcache
        from distcache import session, integrations
        import distcache.integrations.flashinfer
        lazy = ("distcache.collective._download", "distcache.collective._stream",
                "distcache.collective._sync", "distcache.integrations.flashinfer._warm",
                "json")
        loaded = sorted(m for m in lazy if m in sys.modules)
        assert not loaded, loaded
        assert distcache.collective.sync.__module__ == "distcache.collective._sync"
        assert "distcache.collective._sync" in sys.modules
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_auto_makes_its_own_gloo_group_beside_an_initialised_torch_world(
    tmp_path: Path,
) -> None:
    proc = _python(
        f"""
        import torch.distributed as dist
        import distcache.comm
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        comm = distcache.comm.auto(timeout=30, chunk_bytes=1000)
        assert comm.backend == "gloo", comm
        assert comm.group is not dist.group.WORLD
        before = comm.chunk_messages  # the group's set-up broadcast its scope
        assert comm.broadcast_bytes(b"0123456789" * 500, 0) == b"0123456789" * 500
        assert comm.chunk_messages - before == 5  # past the head: 1000-byte chunks
        assert comm.broadcast_bytes(b"0123456789", 0) == b"0123456789"
        assert comm.broadcast_bytes(b"", 0) == b""
        assert comm.allgather_object(("x", 1)) == [("x", 1)]
        comm.barrier()
        sub = comm.split(3)
        assert (sub.rank, sub.size) == (0, 1)
        assert sub.allgather_object(None) == [None]
        comm.close()
        assert dist.is_initialized()  # the engine's group outlives distcache's
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_torch_backend_maps_timeouts_and_failures_to_comm_errors(tmp_path: Path) -> None:
    proc = _python(
        f"""
        import time
        import torch.distributed as dist
        from distcache.comm._backend import Budget
        from distcache.comm._torch import TorchCommunicator
        from distcache.errors import CollectiveTimeout, CommError
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)

        class Work:
            def __init__(self, text): self.text = text
            def wait(self, timeout): raise RuntimeError(self.text)

        def failing(text):
            return lambda *a, **k: Work(text)

        for text, kind in (("Operation timed out!", CollectiveTimeout),
                           ("Connection closed by peer", CommError)):
            comm = TorchCommunicator(timeout=5)
            try:
                comm._run("barrier", Budget(5.0, time.monotonic() + 5.0), failing(text))
            except kind as exc:
                assert type(exc) is kind and isinstance(exc.__cause__, RuntimeError), exc
                assert exc.op == "barrier" and exc.backend == "torch"
            else:
                raise AssertionError("not raised")
            try:
                comm.barrier()
            except CommError as exc:
                assert "unusable" in str(exc)
            else:
                raise AssertionError("a failed communicator was reused")
        dist.destroy_process_group()
        try:
            TorchCommunicator()
        except CommError as exc:
            assert "not initialised" in str(exc)
        else:
            raise AssertionError("no error without a process group")
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_mpi_backend_runs_at_world_size_one_and_maps_mpi_errors() -> None:
    proc = _python(
        """
        from mpi4py import MPI
        from distcache.comm._mpi import MpiCommunicator
        from distcache.errors import CommError
        comm = MpiCommunicator(MPI.COMM_SELF, chunk_bytes=3000, node_id="solo")
        assert (comm.rank, comm.size, comm.node_id, comm.backend) == (0, 1, "solo", "mpi")
        # Past the 4 KiB head a payload goes in chunks: 3000 + 3000 + 1000 bytes.
        assert comm.broadcast_bytes(b"abcdefg" * 1000, 0) == b"abcdefg" * 1000
        assert comm.chunk_messages == 3
        assert comm.broadcast_bytes(b"abcdefg", 0) == b"abcdefg"  # within the head
        assert comm.chunk_messages == 4
        assert comm.allgather_object({1: 2}) == [{1: 2}]
        comm.barrier(timeout=5)
        assert comm.split(-4).size == 1

        def broken(*args):
            raise MPI.Exception(MPI.ERR_OTHER)

        try:
            comm._start("barrier", broken)
        except CommError as exc:
            assert isinstance(exc.__cause__, MPI.Exception) and exc.op == "barrier"
        else:
            raise AssertionError("not translated")
        print("ok")
        """,
        env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_launcher_variables_decide_whether_mpi_is_used() -> None:
    openmpi = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert launcher_is_mpi(openmpi)
    assert launcher_is_mpi({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert not launcher_is_mpi({})
    assert not launcher_is_mpi(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )


def test_auto_rejects_unknown_options() -> None:
    from distcache.comm import auto

    with pytest.raises(TypeError, match="unknown option"):
        auto(chunk=1)


class _FakeWork:
    """A CUDA-style work handle: completes after ``polls`` checks, or never."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.checks = 0
        self.waits = 0

    def is_completed(self) -> bool:
        self.checks += 1
        return self.polls is not None and self.checks > self.polls

    def wait(self) -> bool:
        self.waits += 1
        return True


def test_device_collectives_are_polled_until_done_then_waited() -> None:
    from distcache.comm._torch import TorchCommunicator

    work = _FakeWork(polls=3)
    TorchCommunicator._poll(work, 30.0)
    assert (work.checks, work.waits) == (4, 1)


def test_device_collective_that_never_completes_reports_a_timeout() -> None:
    from distcache.comm._torch import _TIMEOUT_MARKERS, TorchCommunicator

    work = _FakeWork(polls=None)
    with pytest.raises(RuntimeError) as info:
        TorchCommunicator._poll(work, 0.05)
    assert any(marker in str(info.value) for marker in _TIMEOUT_MARKERS)
    assert work.waits == 0 and work.checks > 1


def test_process_groups_held_by_communicators_are_let_go_before_the_interpreter_exits(
    tmp_path: Path,
) -> None:
    # A group kept alive past destroy_process_group() by a communicator used to be
    # destroyed during interpreter finalization, where gloo's worker threads can no
    # longer take the GIL: the process then died in std::terminate after printing "ok".
    # Exit hooks run last-registered first, so the check, registered before distcache
    # is imported (importing distcache.comm registers the release hook), runs after it.
    proc = _python(
        f"""
        import atexit

        held = {{}}

        def check():
            from distcache.errors import CommError

            comm, sub = held["comm"], held["sub"]
            assert comm.group is None and sub.group is None, (comm.group, sub.group)
            try:
                comm.barrier()
            except CommError as exc:
                assert "interpreter exited" in str(exc), exc
            else:
                raise AssertionError("a released communicator still ran a collective")
            print("released")

        atexit.register(check)
        import torch.distributed as dist
        import distcache.comm

        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        comm = distcache.comm.auto(timeout=30, chunk_bytes=4)
        assert comm.broadcast_bytes(b"0123456789", 0) == b"0123456789"
        sub = comm.split(1)
        assert sub.allgather_object(("x", 1)) == [("x", 1)]
        held.update(comm=comm, sub=sub)
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "released"]

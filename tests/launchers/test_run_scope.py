"""Adoptions that share a rendezvous store never meet each other's keys: the launch
wrapper and its program, two ``init`` cycles in one process, a restart, two jobs
(``scope_prog.py`` is each rank)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from distcache.errors import CommError
from distcache.testing import LoopbackOrigin, make_artifacts
from launch import detect, find_store, publish_store
from tests.launchers.procs import BIN, LAUNCH, PY, Result, base_env, run_group
from tests.support.helpers import loopback_store

K = 5
TORCHRUN_2 = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
PROG = ["-m", "tests.launchers.scope_prog"]
_CYCLE = re.compile(r"CYCLE (\d) (\d) (\d) ([0-9a-f]{32}) ([0-9a-f]{12}) (\d+)")
_MET = re.compile(r"MET (\d) (\S+) (\S+) ([\d.]+) ([0-9a-f]{32})")
_FAILED = re.compile(r"FAILED (\d) (\w+) ([\d.]+)")


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, Path]]:
    make_artifacts(tmp_path / "origin", K, min_size=1_000, max_size=5_000, seed=22)
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, tmp_path / "origin" / "checksums.txt"


def _cycles(output: str) -> list[tuple[str, ...]]:
    return sorted(_CYCLE.findall(output), key=lambda row: (row[2], row[0]))


def test_a_program_calling_init_under_the_launch_wrapper_under_torchrun_succeeds(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    # The wrapper's prefetch and the program's init meet on the same torchrun agent
    # store, with the same ranks: each adoption must get keys of its own.
    srv, manifest = origin
    done = run_group(
        [*TORCHRUN_2, *LAUNCH[1:], "--pool", str(tmp_path / "pool"), "--prefetch",
         str(manifest), "--", PY, *PROG, "init", str(manifest), "1"],
        base_env(DISTCACHE_ORIGIN=srv.url), timeout=150,
    )
    assert done.returncode == 0, done.output
    rows = _cycles(done.output)
    assert [(r[0], r[1], r[5]) for r in rows] == [("0", "2", str(K)), ("1", "2", str(K))], (
        done.output)
    assert srv.total_requests == K  # the wrapper fetched; the program found a warm pool


def test_two_init_cycles_in_one_process_after_the_wrapper_each_get_a_scope_of_their_own(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    # Rank 1 comes 4 s late to each init: rank 0 must wait for it, not read an address
    # an earlier adoption (the wrapper's, the first cycle's) left on the agent store.
    srv, manifest = origin
    done = run_group(
        [*TORCHRUN_2, *LAUNCH[1:], "--pool", str(tmp_path / "pool"), "--prefetch",
         str(manifest), "--", PY, *PROG, "init", str(manifest), "2", "4"],
        base_env(DISTCACHE_ORIGIN=srv.url), timeout=150,
    )
    assert done.returncode == 0, done.output
    rows = _cycles(done.output)
    assert [(r[0], r[2]) for r in rows] == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")], (
        done.output)
    by_cycle = [{(r[3], r[4]) for r in rows if r[2] == cycle} for cycle in ("0", "1")]
    # Both ranks agree on each cycle's nonce and secret; the cycles differ.
    assert [len(agreed) for agreed in by_cycle] == [1, 1], done.output
    assert by_cycle[0] != by_cycle[1]
    assert srv.total_requests == K


def test_under_srun_the_program_rehosts_the_wrappers_store_port_at_once(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path], slurm_env: dict[str, str]
) -> None:
    # srun has no agent: the wrapper's rank 0 hosts a store one port above MASTER_PORT,
    # closes it, and the program's rank 0 binds the same port a moment later, twice.
    srv, manifest = origin
    done = run_group(
        ["srun", "-n", "2", "--time=5", *LAUNCH, "--pool", str(tmp_path / "pool"),
         "--prefetch", str(manifest), "--", PY, *PROG, "init", str(manifest), "2"],
        {**slurm_env, "DISTCACHE_ORIGIN": srv.url}, timeout=150,
    )
    assert done.returncode == 0, done.output
    rows = _cycles(done.output)
    assert [(r[0], r[2], r[5]) for r in rows] == [
        ("0", "0", str(K)), ("1", "0", str(K)), ("0", "1", str(K)), ("1", "1", str(K))
    ], done.output
    assert len({r[3] for r in rows}) == 2  # a nonce per cycle, agreed by both ranks
    assert srv.total_requests == K


# -- a store that outlives attempts and jobs, as torchrun's agent store does ------------


@pytest.fixture
def agent_store() -> Iterator[Any]:
    """A TCPStore server on loopback that outlives every process started against it."""
    with loopback_store() as store:
        yield store


def _worker_env(store: Any, job: str, attempt: int, rank: int) -> dict[str, str]:
    return base_env(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        GROUP_RANK="0", GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID=job, TORCHELASTIC_RESTART_COUNT=str(attempt),
    )


def _workers(store: Any, ranks: list[tuple[str, int, int, float]], timeout: float,
             *extra: str) -> list[Result]:
    """Run ``(job, attempt, rank, delay)`` workers at once, each under a hard timeout."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        runs = [pool.submit(run_group, [PY, *PROG, "adopt", str(delay), str(timeout), *extra],
                            _worker_env(store, job, attempt, rank), 90)
                for job, attempt, rank, delay in ranks]
        return [run.result() for run in runs]


def test_after_a_restart_on_the_same_agent_store_a_late_rank_still_meets_its_peer(
    agent_store: Any,
) -> None:
    # Attempt 0 forms its group and dies without cleaning up, leaving its keys (and its
    # peers' addresses) on the store; attempt 1's rank 1 comes 4 s late.
    first = _workers(agent_store, [("job-a", 0, 0, 0.0), ("job-a", 0, 1, 0.0)], 10, "crash")
    assert [r.returncode for r in first] == [0, 0], [r.output for r in first]
    again = _workers(agent_store, [("job-a", 1, 0, 0.0), ("job-a", 1, 1, 4.0)], 10)
    assert [r.returncode for r in again] == [0, 0], [r.output for r in again]
    met = [_MET.search(r.output) for r in again]
    assert all(met), [r.output for r in again]
    rows = [m.groups() for m in met if m]
    before = {m.group(5) for m in (_MET.search(r.output) for r in first) if m}
    # One nonce, agreed by both ranks, and not attempt 0's.
    assert len({row[4] for row in rows}) == 1 and not {row[4] for row in rows} & before
    # Rank 0 waited for its late peer, within the timeout passed.
    assert 3.0 < float(rows[0][3]) < 10.0, rows


def test_a_rank_later_than_the_timeout_gets_a_typed_error_on_every_rank_in_time(
    agent_store: Any,
) -> None:
    first = _workers(agent_store, [("job-a", 0, 0, 0.0), ("job-a", 0, 1, 0.0)], 10, "crash")
    assert [r.returncode for r in first] == [0, 0], [r.output for r in first]
    late = _workers(agent_store, [("job-a", 1, 0, 0.0), ("job-a", 1, 1, 4.0)], 2)
    failed = [_FAILED.search(r.output) for r in late]
    assert all(failed), [r.output for r in late]
    for match in failed:
        assert match is not None
        assert match.group(2) == "CollectiveTimeout", match.group(0)
        # Within the 2 s passed, with a margin for a loaded machine.
        assert float(match.group(3)) < 2.0 + 2.0, match.group(0)
    # Rank 0 waited for its peer until the timeout, rather than failing at once against
    # the address attempt 0's rank 1 left on the store; rank 1, coming after rank 0 gave
    # up, gets no answer and gives up at its own deadline, never dialling an address
    # an earlier process left (gloo's connect timeout would be 10 s or more).
    rank0, rank1 = (m.groups() for m in failed if m is not None)
    assert float(rank0[2]) >= 1.5, rank0
    assert 1.5 <= float(rank1[2]) < 2.0 + 2.0, rank1
    assert "rank 0 did not open" in rank1[0] + " ".join(r.output for r in late)


def test_two_jobs_sharing_one_agent_store_never_meet(agent_store: Any) -> None:
    runs = _workers(agent_store, [("job-a", 0, 0, 0.0), ("job-a", 0, 1, 0.0),
                                  ("job-b", 0, 0, 0.0), ("job-b", 0, 1, 0.0)], 20)
    assert [r.returncode for r in runs] == [0, 0, 0, 0], [r.output for r in runs]
    rows = [m.groups() for m in (_MET.search(r.output) for r in runs) if m]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("0", "job-a", "job-a,job-a"), ("1", "job-a", "job-a,job-a"),
        ("0", "job-b", "job-b,job-b"), ("1", "job-b", "job-b,job-b"),
    ], [r.output for r in runs]
    assert rows[0][4] == rows[1][4] != rows[2][4] == rows[3][4]


# -- the stores distcache hosts --------------------------------------------------------


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def _two_free_ports() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are free on loopback just now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 65535:
            with socket.socket() as above:
                try:
                    above.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two adjacent free ports")


LAUNCH_RANK0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1"}


def test_the_store_rank0_hosts_listens_on_the_launchers_address_only() -> None:
    port = _two_free_ports()
    env = {**LAUNCH_RANK0, "MASTER_PORT": str(port)}
    meeting = find_store(detect(env), 5, env)
    # 127.0.0.1 only (0100007F), not every interface (00000000, or :: in tcp6).
    assert _listening(port + 1) == ["0100007F"]
    del meeting


def test_the_bulk_store_listens_on_the_address_it_publishes_only() -> None:
    host, port, store = publish_store(0, 1, lambda obj: [obj], lambda obj: obj,
                                      timedelta(seconds=5))
    assert host == "127.0.0.1" and _listening(port) == ["0100007F"]
    del store


def test_a_taken_store_port_is_a_clear_error_naming_the_port_and_the_way_out() -> None:
    port = _two_free_ports()
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", port + 1))
        squatter.listen()
        env = {**LAUNCH_RANK0, "MASTER_PORT": str(port)}
        with pytest.raises(CommError, match=rf"127\.0\.0\.1:{port + 1}.*port {port + 1} "
                           r"is in use.*set MASTER_PORT"):
            find_store(detect(env), 5, env)


def test_a_taken_port_derived_from_the_slurm_job_says_so() -> None:
    for job in range(100, 200):
        slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_ID": str(job),
                 "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}
        info = detect(slurm)
        assert info.master_port is not None and info.master_port + 1 < 32768
        with socket.socket() as squatter:
            try:
                squatter.bind(("0.0.0.0", info.master_port + 1))
            except OSError:
                continue  # taken already by something else: try another job
            squatter.listen()
            with pytest.raises(CommError, match=rf"port {info.master_port + 1} is in use.*"
                               "derived from SLURM_JOB_ID; set MASTER_PORT"):
                find_store(info, 5, slurm)
        return
    raise AssertionError("every derived port was taken")


def test_init_process_group_names_a_taken_master_port_and_the_way_out() -> None:
    import torch.distributed as dist

    from launch import init_process_group

    port = _two_free_ports()
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", port))
        squatter.listen()
        env = {**LAUNCH_RANK0, "MASTER_PORT": str(port)}
        with pytest.raises(CommError, match=rf"port {port} is in use.*set MASTER_PORT"):
            init_process_group(detect(env), backend="gloo", timeout=5)
    assert not dist.is_initialized()


def test_gloo_groups_on_one_store_each_agree_a_scope_and_their_splits_share_it() -> None:
    import torch.distributed as dist

    from distcache.comm import GlooCommunicator

    store = dist.HashStore()
    first = GlooCommunicator(store, 0, 1, run=("job-a", 0), timeout=10)
    second = GlooCommunicator(store, 0, 1, run=("job-a", 0), timeout=10)
    try:
        assert first.scope.nonce != second.scope.nonce and first.prefix != second.prefix
        assert len(first.scope.secret) == 32 and first.scope.secret != second.scope.secret
        assert first.prefix == first.scope.prefix
        child = first.split(0)
        assert child.scope == first.scope and child.prefix.startswith(first.prefix + "/")
        assert first.scope.secret.hex() not in repr(first) + repr(child)
    finally:
        first.close()
        second.close()


# -- a client that reaches the store of the adoption before ----------------------------


def test_a_rank_on_the_closing_store_of_the_adoption_before_meets_on_the_next() -> None:
    # srun or the launch wrapper: rank 0 hosts a store per adoption on MASTER_PORT + 1.
    # Rank 1, quick to its next adoption, reaches the previous store in the moment before
    # rank 0 closes it and counts itself in there; the connection then drops under it.
    # It must dial the port again and meet rank 0 on the store rank 0 hosts next.
    import gc

    from distcache.comm import adopt
    from distcache.comm._scope import job_root
    from launch import run_id
    from launch._rendezvous import host_store

    port = _two_free_ports()
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    env0 = {**env, "RANK": "0", "LOCAL_RANK": "0"}
    env1 = {**env, "RANK": "1", "LOCAL_RANK": "1"}
    job, _attempt, _ = run_id(env1)
    counted = f"{job_root(job)}/hello/1"
    old = host_store("127.0.0.1", port + 1, 2, timedelta(seconds=30), spans_hosts=False,
                     what="the earlier adoption's store", hint="")
    with ThreadPoolExecutor(2) as pool:
        second = pool.submit(adopt, environ=env1, timeout=30)
        deadline = time.monotonic() + 30
        while not old.check([counted]):  # rank 1 came to the old store and waits there
            assert time.monotonic() < deadline, "rank 1 never reached the old store"
            assert not second.done(), second.exception()
            time.sleep(0.02)
        del old  # rank 0 closes the earlier store ...
        gc.collect()
        first = pool.submit(adopt, environ=env0, timeout=30)  # ... and hosts the next
        one, zero = second.result(timeout=60), first.result(timeout=60)
        try:
            assert zero.scope.nonce == one.scope.nonce
            assert zero.scope.secret == one.scope.secret
            gathered = [f.result(timeout=60) for f in (
                pool.submit(zero.comm.allgather_object, "r0", timeout=30),
                pool.submit(one.comm.allgather_object, "r1", timeout=30))]
            assert gathered == [["r0", "r1"], ["r0", "r1"]]
        finally:
            zero.close()
            one.close()

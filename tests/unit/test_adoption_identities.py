"""Who each adopting rank is: a rank whose process died and was started again, ranks
that disagree on the world size, an engine's world of its own, the settings of the
environment adopt is given, and MPI variables another job left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache.comm._scope import job_root, meet
from distcache.errors import CollectiveTimeout, LaunchError
from launch import detect
from launch._detect import check_mpi_place

#: The tree whose ``distcache`` and ``launch`` this test imported: subprocesses use it.
ROOT = Path(distcache.__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
#: Generous: only proves that nothing hangs.
PROCESS_LIMIT_S = 120.0


def _hash_store() -> Any:
    import torch.distributed as dist

    return dist.HashStore()


def _soon(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def _until(what: str, ready: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.01)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "OMPI_", "PMI_", "PMIX_", "SLURM_",
                                "TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _start(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen[str]], limit: float = PROCESS_LIMIT_S) -> list[str]:
    """Each process's output; every process group still running at ``limit`` is
    killed (and the test fails)."""
    deadline = time.monotonic() + limit
    outs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            outs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process was still running after {limit} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


def _result(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out
    return dict(json.loads(lines[-1]))


_ADOPT = """
    import json, os, sys
    from distcache.comm import adopt
    try:
        a = adopt(timeout=float(sys.argv[1]))
        got = a.comm.allgather_object(int(os.environ["RANK"]), timeout=30)
        print(json.dumps({"rank": a.comm.rank, "size": a.comm.size, "gathered": got,
                          "nonce": a.scope.nonce, "rendezvous": a.rendezvous}), flush=True)
        a.close()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


def _agent_store() -> Any:
    """A store as torchrun's agent hosts it, every rank a client of it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60),
                         wait_for_workers=False)


def _torchrun_env(port: int, rank: int, size: int, job: str) -> dict[str, str]:
    return _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                TORCHELASTIC_RUN_ID=job, TORCHELASTIC_USE_AGENT_STORE="True")


# -- a rank started again after its process died ----------------------------------------


def test_a_rank_whose_process_died_after_counting_in_is_answered_anew_and_counted_once(
) -> None:
    store = _hash_store()
    root = job_root("j")
    with ThreadPoolExecutor(3) as pool:
        zero = pool.submit(meet, store, 0, 3, "j", 0, _soon())
        # Process A, rank 1: says hello, is answered, counts itself in, then dies.
        dead = os.urandom(16).hex()
        store.set(f"{root}/hello/1", dead)
        _until("rank 0's answer to A", lambda: store.check([f"{root}/ack/1/{dead}"]))
        nonce = bytes(store.get(f"{root}/ack/1/{dead}")).decode().split(":")[0]
        store.set(f"{root}/{nonce}/in/1", dead)
        store.add(f"{root}/{nonce}/arrived", 1)
        # Process B takes rank 1; rank 2 comes after it.
        one = pool.submit(meet, store, 1, 3, "j", 0, _soon())
        _until("B's hello", lambda: bytes(store.get(f"{root}/hello/1")).decode() != dead)
        two = pool.submit(meet, store, 2, 3, "j", 0, _soon())
        got = [f.result(timeout=60) for f in (zero, one, two)]
    assert got == [(nonce, 0)] * 3


def test_a_killed_rank_started_again_meets_the_others_and_the_group_works() -> None:
    store = _agent_store()
    port, job = store.port, "killed-and-restarted"
    root = job_root(f"torchrun:{job}")
    zero = _start(_ADOPT, _torchrun_env(port, 0, 3, job), "40")
    first = _start(_ADOPT, _torchrun_env(port, 1, 3, job), "40")
    procs = [zero, first]
    try:
        # An earlier process's hello for rank 2: rank 0's answer to it names the nonce.
        earlier = os.urandom(16).hex()
        store.set(f"{root}/hello/2", earlier)
        answer = f"{root}/ack/2/{earlier}"
        _until("rank 0's answer", lambda: store.check([answer]), 60)
        counted = f"{root}/{bytes(store.get(answer)).decode().split(':')[0]}/in/1"
        _until("A counting itself in", lambda: store.check([counted]), 60)
        token = bytes(store.get(counted)).decode()
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
        again = _start(_ADOPT, _torchrun_env(port, 1, 3, job), "40")
        procs.append(again)
        _until("B's hello", lambda: bytes(store.get(f"{root}/hello/1")).decode() != token,
               60)
        procs.append(_start(_ADOPT, _torchrun_env(port, 2, 3, job), "40"))
    finally:
        outs = _finish(procs)
    results = [_result(out) for out in (outs[0], outs[2], outs[3])]
    assert [r.get("gathered") for r in results] == [[0, 1, 2]] * 3, outs
    assert len({r["nonce"] for r in results}) == 1


def test_torchrun_restarting_the_whole_group_meets_under_a_new_nonce(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import json, os, sys
        from distcache.comm import adopt
        attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
        a = adopt(timeout=40)
        got = a.comm.allgather_object(int(rank), timeout=30)
        with open(os.path.join(sys.argv[1], f"{attempt}-{rank}.json"), "w") as f:
            json.dump({"gathered": got, "nonce": a.scope.nonce}, f)
        a.close()
        if attempt == "0" and rank == "1":
            sys.exit(3)  # the agent restarts the whole group
    """))
    run = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                            "--monitor-interval=0.2", str(prog), str(tmp_path)], env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    out = _finish([run], 240)[0]
    assert run.returncode == 0, out
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*-*.json")}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1"], out
    assert all(s["gathered"] == [0, 1] for s in seen.values())
    assert seen["0-0"]["nonce"] == seen["0-1"]["nonce"] != seen["1-0"]["nonce"]
    assert seen["1-0"]["nonce"] == seen["1-1"]["nonce"]


# -- ranks that disagree on the world size ------------------------------------------------


def _meetings(store: Any, ranks: list[tuple[int, int]], *, seconds: float = 30,
              waiting: tuple[int, ...] = ()) -> list[BaseException | None]:
    """Each rank's outcome of one meeting; the ranks in ``waiting`` have written their
    hello (they wait on rank 0's answer) before the others start."""
    def one(rank: int, size: int) -> BaseException | None:
        try:
            meet(store, rank, size, "j", 0, _soon(seconds))
        except (LaunchError, CollectiveTimeout) as exc:
            return exc
        return None

    with ThreadPoolExecutor(len(ranks)) as pool:
        first = [pool.submit(one, *r) for r in ranks if r[0] == 0 or r[0] in waiting]
        hellos = [f"{job_root('j')}/hello/{r}" for r in waiting]
        _until("the waiting ranks' hellos", lambda: not hellos or store.check(hellos))
        rest = [pool.submit(one, *r) for r in ranks if r[0] != 0 and r[0] not in waiting]
        return [f.result() for f in first + rest]


def test_a_rank_holding_a_larger_world_fails_both_ranks_naming_both_sizes() -> None:
    got = _meetings(_hash_store(), [(0, 2), (1, 3)])
    for exc in got:
        assert isinstance(exc, LaunchError), got
        assert "rank 1 says WORLD_SIZE=3, rank 0 says 2" in str(exc)


def test_a_rank_holding_a_smaller_world_fails_every_rank_waiting_on_the_meeting() -> None:
    got = _meetings(_hash_store(), [(0, 3), (1, 3), (2, 2)], waiting=(1,))
    for exc in got:
        assert isinstance(exc, LaunchError), got
        assert "rank 2 says WORLD_SIZE=2, rank 0 says 3" in str(exc)


def test_a_rank_coming_after_the_meeting_failed_times_out_saying_it_may_be_late() -> None:
    store = _hash_store()
    got = _meetings(store, [(0, 3), (2, 2)])
    assert all(isinstance(exc, LaunchError) for exc in got), got
    late = _meetings(store, [(1, 3)], seconds=1.5)[0]
    assert isinstance(late, CollectiveTimeout), late
    assert "rank 1/3" in str(late) and "before this process came" in str(late)


def test_a_rank_beyond_rank_0s_world_is_told_so() -> None:
    got = _meetings(_hash_store(), [(0, 2), (2, 3)])
    for exc in got:
        assert isinstance(exc, LaunchError), got
        assert "rank 2 says WORLD_SIZE=3, rank 0 says 2" in str(exc)


# -- an engine with a world of its own ----------------------------------------------------


def test_an_engine_with_a_world_per_replica_leaves_distcache_the_launchers_ranks() -> None:
    engine = """
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    """
    store = _agent_store()
    procs = [_start(textwrap.dedent(engine) + textwrap.dedent(_ADOPT), _torchrun_env(store.port, r, 2, "replicas"), "40")
             for r in range(2)]
    results = [_result(out) for out in _finish(procs)]
    assert [(r.get("rank"), r.get("size")) for r in results] == [(0, 2), (1, 2)], results
    assert all(r["gathered"] == [0, 1] for r in results)
    assert {r["rendezvous"] for r in results} == {"torchrun agent store"}


# -- the settings of the environment adopt is given ---------------------------------------

_SETTINGS = """
    import json, sys
    from distcache.comm import adopt
    env = {"DISTCACHE_TIMEOUT": "7", "DISTCACHE_CHUNK_BYTES": "12345",
           "DISTCACHE_NODE_ID": "node-of-environ"}
    a = adopt(environ=env)
    c = a.comm
    print(json.dumps({"choice": a.choice, "node_id": c.node_id, "rendezvous": a.rendezvous,
                      "timeout": getattr(c, "timeout", None),
                      "chunk_bytes": getattr(c, "chunk_bytes", None)}), flush=True)
    a.close()
"""


@pytest.mark.parametrize("before", ["", "import mpi4py.MPI\n", """
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
"""], ids=["local", "mpi4py-singleton", "gloo"])
def test_adopt_takes_the_settings_of_the_environment_it_is_given(before: str) -> None:
    if "mpi4py" in before:
        pytest.importorskip("mpi4py")
    got = _result(_finish([_start(textwrap.dedent(before) + textwrap.dedent(_SETTINGS),
                                  _env())])[0])
    assert got["node_id"] == "node-of-environ", got
    if got["choice"] != "local":
        assert (got["timeout"], got["chunk_bytes"]) == (7.0, 12345), got
    assert got["choice"] == ("mpi" if "mpi4py" in before else
                             "gloo" if "torch" in before else "local")
    if got["choice"] == "gloo":
        assert got["rendezvous"] == "the engine's default store"


def test_init_gives_its_communicator_the_node_id_of_the_environment_given(
        tmp_path: Path) -> None:
    code = """
        import json, sys, distcache
        env = {"DISTCACHE_NODE_ID": "node-of-environ", "DISTCACHE_POOL_DIR": sys.argv[1]}
        s = distcache.init(environ=env)
        print(json.dumps({"node_id": s.comm.node_id}), flush=True)
        s.close()
    """
    got = _result(_finish([_start(code, _env(), str(tmp_path / "pool"))])[0])
    assert got == {"node_id": "node-of-environ"}


def test_a_timeout_in_the_environment_given_bounds_the_wait_for_a_missing_rank() -> None:
    code = """
        import json, os, socket
        from distcache.comm import adopt
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1] - 1
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "DISTCACHE_TIMEOUT": "2"}
        try:
            adopt(environ=env)
        except Exception as exc:
            print(json.dumps({"error": type(exc).__name__}), flush=True)
    """
    got = _result(_finish([_start(code, _env())], 90)[0])
    assert got == {"error": "CollectiveTimeout"}


# -- MPI variables another job left behind ------------------------------------------------

_STALE = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_mpi_running_alone_under_another_jobs_variables_names_them_to_unset() -> None:
    info = detect(_STALE)
    with pytest.raises(LaunchError) as caught:
        check_mpi_place(info, 0, 1, _STALE)
    text = str(caught.value)
    assert "left from another job" in text and "no launcher started this process" in text
    assert "unset " + " ".join(sorted(_STALE)) in text
    assert "mpi4py is probably linked to a different MPI" in text


def test_mpi_placing_a_rank_elsewhere_in_a_world_of_that_size_blames_no_stale_variables(
) -> None:
    with pytest.raises(LaunchError) as caught:
        check_mpi_place(detect(_STALE), 0, 2, _STALE)
    assert "left from another job" not in str(caught.value)


def test_adopt_in_a_process_holding_another_jobs_mpi_variables_says_what_to_unset() -> None:
    pytest.importorskip("mpi4py")
    code = """
        import json
        from distcache.comm import adopt
        try:
            adopt(timeout=20)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    """
    got = _result(_finish([_start(code, _env(**_STALE))], 90)[0])
    assert got["error"].startswith("LaunchError"), got
    assert "unset " + " ".join(sorted(_STALE)) in got["error"]


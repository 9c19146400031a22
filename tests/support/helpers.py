"""Helpers shared by the test suites: MPI environments and command lines, and (from
:mod:`tests.support.process`) running a command tree under a hard timeout.

Every multi-process test starts its children in a new session (so they form one
process group) and kills the whole group when the time is up, so a rank that hangs
fails the test instead of the run.
"""

from __future__ import annotations

import contextlib
import os
import textwrap
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from tests.support.process import kill_group, mpirun, run_group

__all__ = ["kill_group", "mpi_env", "mpirun", "mpmd_command", "origin_requests", "run_group",
           "serve_slowly"]


def mpi_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """An environment in which ``mpirun`` may run as root and oversubscribe cores."""
    env = dict(os.environ if base is None else base)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PYTHONDONTWRITEBYTECODE="1",
    )
    # Children must import this checkout, whatever the caller's working directory.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def mpmd_command(
    contexts: Sequence[tuple[int, Mapping[str, str], Sequence[str | os.PathLike[str]]]],
) -> list[str]:
    """One MPMD ``mpirun`` command line from ``(nprocs, variables, argv)`` contexts.

    Each application context gets its own ``-x`` variables, which is how one machine
    stands in for several nodes (a ``DISTCACHE_NODE_ID`` per context).
    """
    cmd = [mpirun(), "--oversubscribe"]
    for index, (nprocs, variables, argv) in enumerate(contexts):
        if index:
            cmd.append(":")
        cmd += ["-n", str(nprocs)]
        for key, value in variables.items():
            cmd += ["-x", f"{key}={value}"]
        cmd += [os.fspath(arg) for arg in argv]
    return cmd


def serve_slowly(comm: Any, mirror: Path, count: int, latency: float,
                 seed: int) -> tuple[Any, str]:
    """Collective over ``comm``: rank 0 makes ``count`` artifacts in ``mirror`` (a path
    every rank shares) and serves them, ``latency`` seconds each. Returns the server
    (rank 0; ``None`` elsewhere) and its URL (every rank)."""
    server = None
    if comm.rank == 0:
        from distcache.testing import LoopbackOrigin, make_artifacts

        make_artifacts(mirror, count, min_size=200, max_size=2_000, seed=seed)
        server = LoopbackOrigin(mirror, latency=latency)
    url = comm.broadcast_bytes(server.url.encode() if server is not None else None, 0).decode()
    return server, url


def origin_requests(comm: Any, url: str) -> int:
    """Collective: the loopback origin at ``url``'s request count, read between two
    barriers, so that every rank's requests before the call are in it and none after."""
    import json
    import urllib.request

    comm.barrier()
    with urllib.request.urlopen(url + "/_stats", timeout=30) as answer:
        count = int(json.load(answer)["total_requests"])
    comm.barrier()
    return count


def clear_settings(monkeypatch: Any) -> None:
    """Remove every ``DISTCACHE_*`` variable of the caller's for the test."""
    for var in [v for v in os.environ if v.startswith("DISTCACHE_")]:
        monkeypatch.delenv(var, raising=False)


def isolated_init(monkeypatch: Any, tmp_path: Path) -> Iterator[None]:
    """The body of an autouse fixture for tests that call ``distcache.init`` in the
    test process: no ``DISTCACHE_*`` variable of the caller's, a cache home of the
    test's own, and the process's session closed after the test."""
    clear_settings(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    yield
    from distcache.session import current

    session = current()
    if session is not None:
        session.close()


def watch_close(inside: threading.Event) -> Callable[[FrameType, str, Any], None]:
    """A profile function (for ``sys.setprofile``) for a thread that sets ``inside``
    once the thread, inside ``Session.close``, reaches a lock (where it may block)."""
    from distcache.session import Session

    depth = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal depth
        if frame.f_code is Session.close.__code__ and event in ("call", "return"):
            depth += 1 if event == "call" else -1
        elif depth and event == "c_call" and getattr(arg, "__name__", "") == "acquire":
            inside.set()

    return profile


def on_threads(size: int, body: Any, join: float = 60) -> list[Any]:
    """``body(rank)`` for each rank on a thread of its own (in-process ranks, a
    ``ThreadGroup``'s); each rank's result or what it raised, in rank order. Fails the
    test if a rank is still running after ``join`` seconds."""
    import threading

    out: list[Any] = [None] * size

    def target(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


class PlainIntegration:
    """An integration that is available, offers no origin, wants no artifact and has
    no directory to fill; a test's integration overrides what it watches."""

    install_beside_prefetch = False

    def available(self) -> bool:
        return True

    def default_origin(self) -> str | None:
        return None

    def manifest(self) -> list[Any]:
        return []

    def materialize_dir(self) -> Path | None:
        return None


@contextlib.contextmanager
def loopback_store() -> Iterator[Any]:
    """A torch TCPStore server on loopback, on a port the OS chose, that outlives every
    process started against it (as torchrun's agent store does)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                          wait_for_workers=False)
    try:
        yield store
    finally:
        del store


def node_pools(tmp_path: Path, nodes: list[str]) -> dict[str, Path]:
    """A pool directory per node of ``nodes`` (each rank's node), made before the ranks
    open it."""
    from distcache.store import ArtifactPool

    made = {node: tmp_path / f"pool-{node}" for node in set(nodes)}
    for root in made.values():
        ArtifactPool(root)
    return made


def warnings_kept(prelude: str, body: str) -> str:
    """A child's script: ``prelude`` then ``body`` (dedented; ``body`` sets the dict
    ``out``), with ``json`` and ``logging`` imported, distcache's warnings kept in
    ``records`` and printed with ``out`` on its last line as JSON (``"warnings"``)."""
    return textwrap.dedent("""
        import json, logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("distcache").addHandler(Keep())
        logging.getLogger("distcache").setLevel(logging.WARNING)
        out = {}
    """) + textwrap.dedent(prelude) + textwrap.dedent(body) + textwrap.dedent("""
        out["warnings"] = records
        print(json.dumps(out))
    """)

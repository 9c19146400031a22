"""``python -m launch`` under mpirun finalizes the MPI its rendezvous initialised before
PROGRAM starts, whichever options it was given (PROGRAM's ranks make their own
``MPI_Init``). Run in-process: the rendezvous's MPI is a stand-in for mpi4py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import launch.__main__ as wrapper
from launch import LaunchInfo, detect
from tests.unit.test_launch_nesting import _openmpi


class _MPI:
    """What the wrapper asks of ``mpi4py.MPI``: initialised, as importing it is."""

    def __init__(self) -> None:
        self.finalized = 0

    def Is_initialized(self) -> bool:
        return True

    def Is_finalized(self) -> bool:
        return self.finalized > 0

    def Finalize(self) -> None:
        self.finalized += 1


@pytest.fixture
def mpi(monkeypatch: pytest.MonkeyPatch) -> _MPI:
    """Rank 0 of ``mpirun -n 2`` on one node, whose rendezvous imports the stand-in."""
    fake = _MPI()
    info = detect(_openmpi(0, 2, 0, 2), hostname="n1")

    def publish(info: LaunchInfo, choose: Callable[[list[str]], tuple[str, int]]
                ) -> tuple[str, int]:
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)  # the import is MPI_Init
        return choose(["n1", "n1"])

    monkeypatch.setattr(wrapper, "detect", lambda: info)
    monkeypatch.setattr(wrapper, "mpi_publish", publish)
    # Logging is not under test; the real set-up would outlive the test.
    monkeypatch.setattr(wrapper, "configure_logging", lambda verbose, rank: lambda: None)
    return fake


@pytest.mark.parametrize("options", [[], ["--pool", "pool"], ["--workspace", "ws"],
                                     ["--pool", "pool", "--workspace", "ws"], ["--peers"]])
def test_program_starts_after_the_wrapper_finalized_mpi(
    options: list[str], mpi: _MPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wrapper, "_host_peers", lambda info, pool: None)  # one node: none
    seen: list[tuple[bool, str | None]] = []

    def program(command: list[str], env: dict[str, str], terminal: bool) -> int:
        seen.append((mpi.Is_finalized(), env.get("MASTER_ADDR")))
        return 0

    monkeypatch.setattr(wrapper, "run", program)
    paths = [str(tmp_path / o) if o in ("pool", "ws") else o for o in options]
    with pytest.raises(SystemExit) as exited:
        wrapper.main([*paths, "--", "true"])
    assert exited.value.code == 0
    assert seen == [(True, "127.0.0.1")], "PROGRAM started beside the wrapper's MPI"
    assert mpi.finalized == 1


def test_a_failed_set_up_after_the_rendezvous_exits_with_mpi_finalized(
    mpi: _MPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(wrapper, "run", lambda *a, **k: pytest.fail("PROGRAM ran"))
    taken = tmp_path / "taken"
    taken.write_text("a file where the workspace would go\n")
    with pytest.raises(SystemExit) as exited:
        wrapper.main(["--workspace", str(taken), "--", "true"])
    assert exited.value.code == 1
    assert str(taken) in capsys.readouterr().err
    assert mpi.finalized == 1


def test_materialize_without_prefetch_is_refused_before_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bad usage on every rank alike: no rendezvous (no MPI_Init, no wait on the
    # others), no workspace slot taken, no node agent started for --peers.
    for name in ("detect", "mpi_publish", "acquire_slot", "_host_peers", "run"):
        monkeypatch.setattr(wrapper, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))
    with pytest.raises(SystemExit) as exited:
        wrapper.main(["--peers", "--workspace", "ws", "--materialize", "out", "--", "true"])
    assert exited.value.code == 2
    assert "--materialize needs --prefetch" in capsys.readouterr().err

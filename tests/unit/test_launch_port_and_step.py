"""``python -m launch`` under MPI chooses a ``MASTER_PORT`` whose next port (where the
program's distcache hosts its store) is safe too; and a PMIx launcher inside a Slurm
allocation is described the same way on every rank, whatever the daemons' step says."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import launch.__main__ as wrapper
import launch._rendezvous
from launch import LaunchError, LaunchInfo, detect
from launch.__main__ import child_environment
from launch._dist import agree_on_address
from tests.unit.test_launch_nesting import _daemon_step, _openmpi

# -- MASTER_PORT under MPI -------------------------------------------------------------


def _host_range() -> tuple[int, int]:
    """This host's ephemeral range, read here independently of the code under test."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


@pytest.fixture
def rank0(monkeypatch: pytest.MonkeyPatch) -> LaunchInfo:
    """Rank 0 of ``mpirun -n 2`` on one node; the rendezvous's MPI round is the real
    agreement (rank 0 chooses, every rank gets its answer or its error) over a stand-in
    transport of one rank."""

    def publish(info: LaunchInfo, choose: Callable[[list[str]], tuple[str, int]]
                ) -> tuple[str, int]:
        return agree_on_address(info.rank, lambda m: [m, m], lambda m: m, choose)

    monkeypatch.setattr(wrapper, "mpi_publish", publish)
    return detect(_openmpi(0, 2, 0, 2), hostname="n1")


def test_the_wrapper_under_mpi_picks_a_port_pair_below_the_ephemeral_range(
    rank0: LaunchInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bind(0) answers from the ephemeral range, where the port above the one chosen may
    # be any outgoing connection's local end when the program's store binds it.
    low, _ = _host_range()
    for _ in range(5):
        info = wrapper._rendezvous(rank0)
        assert info.master_addr == "127.0.0.1"
        assert info.master_port is not None
        assert info.master_port >= 1024 and info.master_port + 1 < low, info.master_port
    # A MASTER_PORT the user set is kept as it is.
    chosen = detect({**_openmpi(0, 2, 0, 2), "MASTER_PORT": "45001"}, hostname="n1")
    assert wrapper._rendezvous(chosen).master_port == 45001


def _outgoing_from(port: int, server: socket.socket) -> socket.socket:
    """A connection whose local end is ``port``, as the kernel may hand out."""
    client = socket.socket()
    client.bind(("127.0.0.1", port))
    client.connect(server.getsockname())
    return client


@pytest.fixture
def high_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """An ephemeral range of ``1024-65530``, which leaves only 65531-65534 for ``P``
    (with ``P + 1`` up to 65535): every candidate can be taken by the test."""
    ports = list(range(65531, 65536))
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                pytest.skip(f"port {port} is in use on this host")
    table = tmp_path / "ip_local_port_range"
    table.write_text("1024\t65530\n")
    # raising=False: without the fix the wrapper never reads the range.
    monkeypatch.setattr(launch._rendezvous, "PORT_RANGE_FILE", str(table), raising=False)
    yield ports


def test_the_wrapper_under_mpi_skips_a_port_whose_next_port_is_taken(
    rank0: LaunchInfo, high_ports: list[int]
) -> None:
    # 65532 is the local end of an outgoing connection and 65535 has a listener: of the
    # candidates 65531-65534 only 65533 has itself and the port above it free.
    server = socket.create_server(("127.0.0.1", 0))
    taken = [_outgoing_from(65532, server), socket.create_server(("127.0.0.1", 65535)), server]
    try:
        ports = {wrapper._rendezvous(rank0).master_port for _ in range(5)}
    finally:
        for sock in taken:
            sock.close()
    assert ports == {65533}


def test_the_wrapper_under_mpi_fails_clearly_when_no_port_pair_is_free(
    rank0: LaunchInfo, high_ports: list[int], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(wrapper, "detect", lambda: rank0)
    monkeypatch.setattr(wrapper, "configure_logging", lambda verbose, rank: lambda: None)
    monkeypatch.setattr(wrapper, "run", lambda *a, **k: pytest.fail("PROGRAM ran"))
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    # Each candidate (65531-65534) is taken, or the port above it is.
    taken = [socket.create_server(("127.0.0.1", port)) for port in (65532, 65534)]
    try:
        with pytest.raises(SystemExit) as exited:
            wrapper.main(["--", "true"])
    finally:
        for sock in taken:
            sock.close()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "could not choose a rendezvous address" in err
    assert "MASTER_PORT" in err and "65531-65534" in err


# -- a PMIx launcher inside a Slurm allocation -----------------------------------------

#: ``prterun -n 4`` (two ranks per node) in a two-node allocation whose ``srun`` step
#: started PRRTE's daemons: (PMIX_RANK, node).
PRTERUN_RANKS = [(0, 0), (1, 0), (2, 1), (3, 1)]


def _prterun(rank: int, node: int) -> dict[str, str]:
    return {**_daemon_step(node), "PMIX_RANK": str(rank), "PMIX_NAMESPACE": "prterun-n1-1@1"}


def test_prterun_ranks_in_an_allocation_all_fail_alike_without_a_world_size() -> None:
    # Rank 0's PMIX_RANK equals the daemon step's SLURM_PROCID; that must not make the
    # daemons' step (2 tasks) rank 0's job while the other ranks find no size at all.
    outcomes = []
    for rank, node in PRTERUN_RANKS:
        with pytest.raises(LaunchError) as raised:
            detect(_prterun(rank, node), hostname=f"n{node + 1}")
        outcomes.append((raised.value.variable, str(raised.value)))
    assert {variable for variable, _ in outcomes} == {"PMIX_RANK"}
    assert len({message for _, message in outcomes}) == 1
    message = outcomes[0][1]
    assert "no variable gives the world size" in message
    assert "'slurm.pmix.77.0'" in message and "'prterun-n1-1@1'" in message


def test_prterun_ranks_given_a_world_size_all_ignore_the_daemon_step() -> None:
    # The work-around the error names (RANK=$PMIX_RANK, WORLD_SIZE) and, through the
    # wrapper, what its program sees: every rank is the same job of 4 (rank 0's
    # PMIX_RANK matching the daemon step must not bring in that step's 2 tasks).
    for rank, node in PRTERUN_RANKS:
        env = {**_prterun(rank, node), "RANK": str(rank), "WORLD_SIZE": "4"}
        info = detect(env, hostname=f"n{node + 1}")
        assert (info.launcher, info.rank, info.world_size) == ("torchrun", rank, 4)
        assert not any(v.startswith("SLURM_") for v in info.source)
        program_env = child_environment(info.replace(master_addr="n1", master_port=20000),
                                        env, {})
        program = detect(program_env, hostname=f"n{node + 1}")
        assert (program.rank, program.world_size, program.num_nodes) == (rank, 4, None)


def test_srun_pmix_namespace_of_another_step_does_not_make_the_step_this_jobs() -> None:
    # Slurm's own namespace counts only for the step it names: a launcher started from
    # step 0 whose ranks carry step 0's namespace is still seen as that step (srun
    # --mpi=pmix), while a rank whose namespace names step 1 is not.
    own = {**_prterun(0, 0), "PMIX_NAMESPACE": "slurm.pmix.77.0"}
    assert detect(own, hostname="n1").world_size == 2
    other = {**_prterun(0, 0), "PMIX_NAMESPACE": "slurm.pmix.77.1"}
    with pytest.raises(LaunchError, match="no variable gives the world size"):
        detect(other, hostname="n1")

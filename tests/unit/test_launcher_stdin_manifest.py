"""A manifest that is the standard input a launcher forwards is refused at once, on
every rank, instead of waiting for an end of input that Open MPI never sends (or being
read by one rank only); a process fed by a shell's ``|`` still reads it, a rank's own
pipeline under a launcher too.

The launchers' processes are told by their names (``/proc/PID/comm``): a link named
``prted`` (or ``hydra_pmi_proxy``) to this interpreter is such a process to the check,
and the real ``mpirun`` and ``torchrun`` are run as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.helpers import mpi_env, mpirun, run_group

SHA = "a" * 64
LINE = f"{SHA}  k.cubin\n"
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE",
                    "PMI_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "RANK", "LOCAL_RANK")

#: What a rank does: read the manifest named on its command line, say what it got.
READ = textwrap.dedent("""
    import sys
    from distcache.artifact import read_manifest
    from distcache.errors import ConfigError
    try:
        print("read:", [a.name for a in read_manifest(sys.argv[1])], flush=True)
    except ConfigError as exc:
        print("refused:", exc, flush=True)
    """)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def _as(tmp_path: Path, name: str, rank_argv: list[str], *, share: bool = False,
        **env: str) -> str:
    """Start ``rank_argv`` from a process named ``name`` (a link to this interpreter);
    what the rank printed. The rank's standard input is a pipe that process feeds
    :data:`LINE` into and closes, as an MPI launcher's daemon does, or with ``share``
    the process's own standard input, fed so by this test (torchrun's workers inherit
    the agent's). A hang is killed and fails."""
    launcher = tmp_path / name
    launcher.symlink_to(sys.executable)
    feed = "" if share else f", input={LINE!r}"
    code = textwrap.dedent(f"""
        import subprocess, sys
        done = subprocess.run({rank_argv!r}{feed}, capture_output=True, text=True,
                              timeout=60)
        sys.stdout.write(done.stdout + done.stderr)
        """)
    done = subprocess.run([str(launcher), "-c", code], capture_output=True, text=True,
                          timeout=90, env=_env(**env), start_new_session=True,
                          input=LINE if share else None,
                          stdin=None if share else subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _rank(path: str = "/dev/stdin") -> list[str]:
    return [sys.executable, "-c", READ, path]


@pytest.mark.parametrize("share", [False, True])
def test_a_process_fed_by_a_shell_pipe_reads_its_standard_input(
        tmp_path: Path, share: bool) -> None:
    assert _as(tmp_path, "bash", _rank(), share=share) == "read: ['k.cubin']"


@pytest.mark.parametrize("daemon", ["prted", "prterun", "orted"])
def test_standard_input_an_open_mpi_process_forwards_is_refused(
        tmp_path: Path, daemon: str) -> None:
    said = _as(tmp_path, daemon, _rank(), OMPI_COMM_WORLD_SIZE="1")
    assert said.startswith("refused: cannot read manifest /dev/stdin: it is this rank's "
                           "standard input, and Open MPI forwards it to rank 0 alone"), said
    assert "write the manifest to a file every rank can read" in said


def test_a_link_to_standard_input_is_refused_as_it_is(tmp_path: Path) -> None:
    link = tmp_path / "manifest"
    link.symlink_to("/dev/stdin")
    said = _as(tmp_path, "prted", _rank(str(link)))
    assert said.startswith(f"refused: cannot read manifest {link}"), said


def test_input_inherited_through_a_shell_is_refused(tmp_path: Path) -> None:
    # The rank is a script whose python inherits the daemon's pipe unchanged.
    script = f"{sys.executable} -c '{READ}' /dev/stdin; true"
    assert _as(tmp_path, "prted", ["bash", "-c", script]).startswith("refused:")


def test_a_ranks_own_pipeline_under_a_launcher_is_read(tmp_path: Path) -> None:
    script = f"printf '{LINE.strip()}\\n' | {sys.executable} -c '{READ}' /dev/stdin"
    assert _as(tmp_path, "prted", ["bash", "-c", script]) == "read: ['k.cubin']"


def test_other_files_are_read_under_a_launcher(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text(LINE)
    # /dev/null is every other rank's standard input under Open MPI: named as itself
    # it is an empty manifest, not the launcher's input.
    script = (f"{sys.executable} -c '{READ}' /dev/null; "
              f"{sys.executable} -c '{READ}' <(cat {manifest}); "
              f"{sys.executable} -c '{READ}' <(cat {manifest}) 0<&-; "
              f"{sys.executable} -c '{READ}' /dev/stdin < {manifest}")
    said = _as(tmp_path, "prted", ["bash", "-c", script]).splitlines()
    assert said == ["read: []"] + ["read: ['k.cubin']"] * 3


@pytest.mark.parametrize(("size", "refused"), [("2", True), ("1", False)])
def test_mpich_refuses_only_with_more_than_one_rank(
        tmp_path: Path, size: str, refused: bool) -> None:
    said = _as(tmp_path, "hydra_pmi_proxy", _rank(), PMI_SIZE=size)
    assert said.startswith("refused:" if refused else "read:"), said
    assert not refused or "MPICH forwards it to rank 0 alone" in said


@pytest.mark.parametrize(("local", "world", "refused"), [
    ("2", "2", True), ("1", "2", False), (None, "2", True), (None, "1", False),
    ("abc", "2", False)])
def test_torchrun_refuses_where_workers_of_a_node_share_it(
        tmp_path: Path, local: str | None, world: str, refused: bool) -> None:
    env = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": world}
    if local is not None:
        env["LOCAL_WORLD_SIZE"] = local
    said = _as(tmp_path, "python3", _rank(), share=True, **env)
    assert said.startswith("refused:" if refused else "read:"), said
    assert not refused or "torchrun's workers on this node share it" in said


@pytest.mark.parametrize("ranks", [1, 2])
def test_prefetch_of_stdin_under_mpirun_fails_at_once_with_one_line(
        tmp_path: Path, ranks: int) -> None:
    (tmp_path / "origin").mkdir()
    proc = run_group(
        [mpirun(), "-n", str(ranks), sys.executable, "-m", "distcache", "prefetch",
         "--manifest", "/dev/stdin", "--pool", str(tmp_path / "pool"),
         "--origin", (tmp_path / "origin").as_uri()],
        timeout=120, env=mpi_env(), input=LINE.encode())
    said = [line for line in proc.stderr.splitlines()
            if line.startswith("distcache prefetch: cannot read manifest /dev/stdin")]
    assert proc.returncode != 0
    assert len(said) == 1, proc.stdout + proc.stderr  # every rank refused; one reports
    assert "Open MPI forwards it to rank 0 alone" in said[0]


def test_a_pipeline_inside_each_rank_under_mpirun_is_read(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text(LINE)
    script = f"cat {manifest} | {sys.executable} -c '{READ}' /dev/stdin"
    proc = run_group([mpirun(), "-n", "2", "bash", "-c", script], timeout=120,
                     env=mpi_env())
    assert proc.stdout.splitlines() == ["read: ['k.cubin']"] * 2, proc.stdout + proc.stderr


def test_torchrun_workers_given_their_own_input_read_it(tmp_path: Path) -> None:
    said = _as(tmp_path, "python3", _rank(), TORCHELASTIC_RUN_ID="r", LOCAL_WORLD_SIZE="2",
               WORLD_SIZE="2")
    assert said == "read: ['k.cubin']"


@pytest.mark.parametrize(("workers", "expected"), [
    (2, ["refused"] * 2), (1, ["read: ['k.cubin']"])])
def test_real_torchrun_workers_sharing_standard_input_are_refused(
        tmp_path: Path, workers: int, expected: list[str]) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "rank.py"
    script.write_text(READ)
    proc = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={workers}", str(script), "/dev/stdin"],
        timeout=120, env=_env(), input=LINE.encode())
    said = sorted(line.split(":")[0] if line.startswith("refused") else line
                  for line in proc.stdout.splitlines() if line.startswith(("read", "refused")))
    assert said == expected, proc.stdout + proc.stderr
    assert workers == 1 or "torchrun's workers on this node share it" in proc.stdout

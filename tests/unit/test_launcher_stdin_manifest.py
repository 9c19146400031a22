"""A manifest that is the standard input a launcher forwards is refused at once, on
every rank, instead of waiting for an end of input that Open MPI never sends (or being
read by one rank only); a lone process fed by a shell's ``|`` still reads it."""

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
LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "TORCHELASTIC_RUN_ID",
             "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")

READ = """
    import sys
    from distcache.artifact import read_manifest
    from distcache.errors import ConfigError
    try:
        print("read:", [a.name for a in read_manifest(sys.argv[1])])
    except ConfigError as exc:
        print("refused:", exc)
    """


def _read_in_child(path: str, stdin: int | None, **env: str) -> str:
    """What ``read_manifest(path)`` does in a child whose standard input is ``stdin``
    (a file descriptor; ``None``: a pipe fed :data:`LINE` and closed) and whose
    launcher variables are only ``env``. A hang is killed with its group and fails."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHERS}
    root = str(Path(__file__).resolve().parents[2])
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(READ), path],
                          input=LINE if stdin is None else None, stdin=stdin,
                          capture_output=True, text=True, timeout=60,
                          env={**base, **env}, start_new_session=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_lone_process_fed_by_a_shell_pipe_reads_its_standard_input() -> None:
    assert _read_in_child("/dev/stdin", None) == "read: ['k.cubin']"


@pytest.mark.parametrize(("env", "launcher"), [
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, "Open MPI"),
    ({"PMIX_RANK": "0"}, "PMIx"),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, "MPICH"),
    ({"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "RANK": "0"}, "torchrun"),
])
def test_standard_input_forwarded_by_a_launcher_is_refused_naming_it(
        env: dict[str, str], launcher: str) -> None:
    said = _read_in_child("/dev/stdin", None, **env)
    assert said.startswith("refused: cannot read manifest /dev/stdin: it is this rank's "
                           "standard input"), said
    assert launcher in said and "write the manifest to a file" in said


@pytest.mark.parametrize("env", [{"PMI_SIZE": "1", "PMI_RANK": "0"},
                                 {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "1"},
                                 {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "abc"}])
def test_a_launcher_that_gives_its_only_rank_the_whole_input_is_read(
        env: dict[str, str]) -> None:
    assert _read_in_child("/dev/stdin", None, **env) == "read: ['k.cubin']"


def test_a_regular_file_as_standard_input_is_read_under_a_launcher(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text(LINE)
    with open(manifest, "rb") as f:
        said = _read_in_child("/dev/stdin", f.fileno(), OMPI_COMM_WORLD_SIZE="2")
    assert said == "read: ['k.cubin']"  # every rank opening it reads it from its start


def test_an_empty_standard_input_of_another_rank_is_refused_too() -> None:
    # Open MPI gives every rank but 0 /dev/null: it refuses alike, so the ranks agree.
    with open(os.devnull, "rb") as null:
        said = _read_in_child("/dev/stdin", null.fileno(), OMPI_COMM_WORLD_SIZE="2")
    assert said.startswith("refused:") and "Open MPI" in said, said


def test_another_pipe_under_a_launcher_is_read(tmp_path: Path) -> None:
    script = tmp_path / "other_pipe.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from distcache.artifact import read_manifest
        r, w = os.pipe()
        os.write(w, {LINE!r}.encode())
        os.close(w)
        print("read:", [a.name for a in read_manifest(f"/dev/fd/{{r}}")])
        """))
    env = {k: v for k, v in mpi_env().items() if k not in LAUNCHERS}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env={**env, "OMPI_COMM_WORLD_SIZE": "2"},
                          start_new_session=True, stdin=subprocess.DEVNULL)
    assert done.stdout.strip() == "read: ['k.cubin']", done.stderr


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
    assert "Open MPI forwards to rank 0 alone" in said[0]

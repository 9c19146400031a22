"""A manifest given to the library as a named pipe is refused at once, naming it,
instead of waiting for ever for a writer; a pipe a shell made is still read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distcache.artifact import read_manifest
from distcache.errors import ConfigError

SHA = "a" * 64


def _in_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # A hang is killed with its process group and fails the test, never the run.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


def test_a_named_pipe_without_a_writer_is_refused_naming_it(tmp_path: Path) -> None:
    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    done = _in_child(f"""
        from distcache.artifact import read_manifest
        from distcache.errors import ConfigError
        try:
            read_manifest({str(fifo)!r})
        except ConfigError as exc:
            print("refused:", exc)
        """)
    assert done.returncode == 0, done.stderr
    assert f"refused: cannot read manifest {fifo}" in done.stdout
    assert "named pipe (FIFO)" in done.stdout


def test_the_start_up_digest_of_a_named_pipe_does_not_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    done = _in_child(f"""
        from distcache._prepare import inputs_key
        print("key:", inputs_key([{str(fifo)!r}], None, False))
        """)
    assert done.returncode == 0, done.stderr
    assert "key: None" in done.stdout  # unreadable: the prefetch reports why


def test_a_pipe_a_shell_made_is_still_read(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, f"{SHA}  k.cubin\n".encode())
        os.close(write_end)
        write_end = -1
        (artifact,) = read_manifest(f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert (artifact.name, artifact.sha256) == ("k.cubin", SHA)


def test_a_regular_file_is_read_as_before(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text(f"{SHA}  k.cubin\n")
    assert [a.name for a in read_manifest(manifest)] == ["k.cubin"]
    with pytest.raises(ConfigError, match="cannot read manifest"):
        read_manifest(tmp_path / "absent.txt")

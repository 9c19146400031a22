"""The FlashInfer usage record against planted and oversized files: a FIFO, a
directory or a symlink under a record name is neither waited on nor written through,
and a huge line or a huge file is read in bounded memory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from distcache.errors import ArtifactNameError, ManifestError
from distcache.integrations.flashinfer import _record
from distcache.integrations.flashinfer._record import COMPACT_SUFFIX, Recorder, read_record

REPO = Path(__file__).resolve().parents[2]
HOST = _record._host()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (what would hang cannot hang the test run)."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s")


@pytest.mark.parametrize("fifo", ["other-host-7.txt", f"{HOST}-7-rank0.txt"])
def test_a_fifo_in_the_record_directory_does_not_hang_the_read(tmp_path: Path,
                                                               fifo: str) -> None:
    (tmp_path / "other-host-8.txt").write_text(f"{sha(b'a')}  pin/a.cubin\n")
    os.mkfifo(tmp_path / fifo)
    done = _run(f"""
        from distcache.integrations.flashinfer._record import read_record
        print(sorted(read_record({str(tmp_path)!r})))
    """, timeout=20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['pin/a.cubin']"
    assert "not a regular file" in done.stderr


def test_a_directory_named_like_a_record_file_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "other-host-8.txt").write_text(f"{sha(b'a')}  pin/a.cubin\n")
    (tmp_path / "planted.txt").mkdir()
    (tmp_path / f"{HOST}-9.txt").mkdir()
    assert read_record(tmp_path) == {"pin/a.cubin": sha(b"a")}
    assert (tmp_path / f"{HOST}-9.txt").is_dir()


def test_a_symlink_at_a_writers_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.conf"
    victim.write_text("setting = 1\n")
    record = tmp_path / "rec"
    record.mkdir()
    (record / "h-7.txt").symlink_to(victim)
    recorder = Recorder(record, "h-7.txt")
    assert not recorder.add("pin/a.cubin", sha(b"a"))
    recorder.close()
    assert victim.read_text() == "setting = 1\n"


def test_a_fifo_at_a_writers_name_does_not_block_serving(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "h-7.txt")
    done = _run(f"""
        import hashlib
        from distcache.integrations.flashinfer._record import Recorder
        recorder = Recorder({str(tmp_path)!r}, "h-7.txt")
        written = sum(recorder.add(f"pin/k{{i}}.cubin", hashlib.sha256(b"%d" % i).hexdigest())
                      for i in range(3000))
        print("written", written)
    """, timeout=20)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "written 0"
    assert "not a regular file" in done.stderr


def test_a_huge_line_is_refused_without_being_read_whole(tmp_path: Path) -> None:
    with open(tmp_path / "other-host-7.txt", "wb") as file:
        file.write(f"{sha(b'a')}  pin/a.cubin\n".encode())
        file.write(sha(b"b").encode() + b"  " + b"x" * 40_000_000 + b"\n")
    tracemalloc.start()
    try:
        with pytest.raises((ManifestError, ArtifactNameError), match=r"other-host-7\.txt:2"):
            read_record(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak


@pytest.mark.parametrize("name", ["other-host-7.txt", f"{HOST}-7.txt"])
def test_a_file_of_many_lines_is_read_in_memory_bounded_by_max_entries(
    tmp_path: Path, name: str
) -> None:
    digest = sha(b"k")
    with open(tmp_path / name, "w") as file:
        file.writelines(f"{digest}  pin/k{i}.cubin\n" for i in range(150_000))
    tracemalloc.start()
    try:
        got = read_record(tmp_path, max_entries=1_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert list(got) == [f"pin/k{i}.cubin" for i in range(149_000, 150_000)]
    assert peak < 5_000_000, peak
    if name.startswith(HOST):
        compact = (tmp_path / (HOST + COMPACT_SUFFIX)).read_text().splitlines()
        assert len(compact) == 1_000


def test_no_entries_wanted_gives_none(tmp_path: Path) -> None:
    (tmp_path / "other-host-7.txt").write_text(f"{sha(b'a')}  pin/a.cubin\n")
    assert read_record(tmp_path, max_entries=0) == {}

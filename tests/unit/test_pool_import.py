"""``distcache pool import`` of wheels, tarballs and pinned directories, and ``pool
export --tar``, through the real command line: names as FlashInfer asks for them,
every file verified, and bad input refused with nothing published."""

from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Protocol

import pytest

REPO = Path(__file__).resolve().parents[2]
PIN = "0123456789abcdef0123456789abcdef01234567/fmha/trtllm-gen"
FILES = {
    "fmhaSm100aKernel_QBf16H128.cubin": b"sm100 kernel" * 50,
    "fmhaSm90aKernel_QBf16H128.cubin": b"sm90 kernel" * 40,
    "include/flashInferMetaInfo.h": b"#pragma once\n",
}


class Run(Protocol):
    def __call__(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]: ...


def cli_runner(tmp_path: Path) -> Run:
    """Run ``python -m distcache ARGS`` with no DISTCACHE_* settings and a private cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)})

    def run(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "distcache", *args], capture_output=True,
                              text=True, env=env, timeout=120, start_new_session=True,
                              check=False, input=input)

    return run


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return cli_runner(tmp_path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checksums(files: dict[str, bytes], extra: str = "") -> bytes:
    return ("".join(f"{_sha(d)}  {n}\n" for n, d in files.items()) + extra).encode()


def make_wheel(path: Path, files: dict[str, bytes] = FILES, manifest: bytes | None = None) -> Path:
    """A flashinfer-cubin-shaped wheel: package code, one pin, dist-info."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("flashinfer_cubin/__init__.py", "CUBIN_DIR = None\n")
        wheel.writestr(f"flashinfer_cubin/cubins/{PIN}/checksums.txt",
                       manifest if manifest is not None else checksums(files))
        for name, data in files.items():
            wheel.writestr(f"flashinfer_cubin/cubins/{PIN}/{name}", data)
        wheel.writestr("flashinfer_cubin-9.9.9.dist-info/RECORD", "")
    return path


def pool_labels(run: Run, pool: Path) -> dict[str, str]:
    done = run("--pool", str(pool), "pool", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return {a["name"]: a["sha256"] for a in json.loads(done.stdout)["artifacts"]}


def objects(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "objects").rglob("*") if p.is_file())


def expected_labels(files: dict[str, bytes] = FILES) -> dict[str, str]:
    labels = {f"{PIN}/{n}": _sha(d) for n, d in files.items()}
    labels[f"{PIN}/checksums.txt"] = _sha(checksums(files))
    return labels


def test_wheel_is_labelled_the_way_flashinfer_asks(tmp_path: Path, run: Run) -> None:
    wheel = make_wheel(tmp_path / "flashinfer_cubin-9.9.9-py3-none-any.whl")
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 0, done.stderr
    assert "imported 4 artifacts" in done.stdout and "3 checked against 1 checksums.txt" in done.stdout
    assert pool_labels(run, tmp_path / "pool") == expected_labels()


def test_a_second_version_stores_only_what_changed(tmp_path: Path, run: Run) -> None:
    pool = str(tmp_path / "pool")
    assert run("--pool", pool, "pool", "import",
               str(make_wheel(tmp_path / "a.whl"))).returncode == 0
    changed = {**FILES, "fmhaSm90aKernel_QBf16H128.cubin": b"new sm90 kernel"}
    done = run("--pool", pool, "pool", "import", "--json", str(make_wheel(tmp_path / "b.whl",
                                                                         changed)))
    assert done.returncode == 0, done.stderr
    # The new kernel and the new checksums.txt are new; the other two were already there.
    assert json.loads(done.stdout)["new_objects"] == 2


def test_listed_files_absent_from_the_wheel_are_reported_not_fatal(tmp_path: Path,
                                                                   run: Run) -> None:
    wheel = make_wheel(tmp_path / "w.whl",
                       manifest=checksums(FILES, f"{'1' * 64}  x86_64/missing.so\n"))
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 0, done.stderr
    assert "1 listed files not in the source" in done.stdout


def test_checksum_mismatch_refuses_the_whole_import(tmp_path: Path, run: Run) -> None:
    bad = checksums({**FILES, "fmhaSm90aKernel_QBf16H128.cubin": b"other bytes"})
    wheel = make_wheel(tmp_path / "w.whl", manifest=bad)
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 1
    assert "sha256 mismatch" in done.stderr and "fmhaSm90aKernel_QBf16H128.cubin" in done.stderr
    assert "nothing was imported" in done.stderr
    assert objects(tmp_path / "pool") == []
    assert pool_labels(run, tmp_path / "pool") == {}


@pytest.mark.parametrize("listing", [b"not a checksums line\n",
                                     f"{'1' * 64}  ../../outside.cubin\n".encode()])
def test_a_malformed_checksums_txt_is_refused(tmp_path: Path, run: Run, listing: bytes) -> None:
    wheel = make_wheel(tmp_path / "w.whl", manifest=checksums(FILES) + listing)
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 1
    assert "checksums.txt is malformed" in done.stderr and "nothing was imported" in done.stderr
    assert objects(tmp_path / "pool") == []


@pytest.mark.parametrize("damage", ["truncated", "bad-crc", "not-a-zip"])
def test_a_corrupt_wheel_is_refused_with_nothing_published(tmp_path: Path, run: Run,
                                                           damage: str) -> None:
    wheel = make_wheel(tmp_path / "w.whl", {**FILES, "big.cubin": os.urandom(1) * 20_000})
    data = bytearray(wheel.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "bad-crc":
        # Flip a byte inside the stored data of the first file: its CRC no longer holds.
        data[60] ^= 0xFF
    else:
        data = bytearray(b"garbage" * 100)
    wheel.write_bytes(bytes(data))
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 1, done.stdout
    assert "cannot import" in done.stderr and "nothing was imported" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert objects(tmp_path / "pool") == []


def _tar(path: Path, members: list[tarfile.TarInfo], data: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info in members:
            payload = data.get(info.name)
            archive.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def _file(name: str, data: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


@pytest.mark.parametrize("evil", ["../escape.cubin", "/abs/escape.cubin", "a/../../x.cubin",
                                  "symlink", "hardlink", "device"])
def test_a_tarball_with_an_unsafe_member_is_refused(tmp_path: Path, run: Run, evil: str) -> None:
    good = {f"{PIN}/{n}": d for n, d in FILES.items()}
    members = [_file(n, d) for n, d in good.items()]
    bad = tarfile.TarInfo(f"{PIN}/evil.cubin")
    if evil == "symlink":
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif evil == "hardlink":
        bad.type, bad.linkname = tarfile.LNKTYPE, f"{PIN}/include/flashInferMetaInfo.h"
    elif evil == "device":
        bad.type = tarfile.CHRTYPE
    else:
        bad = _file(evil, b"x")
        good[evil] = b"x"
    archive = _tar(tmp_path / "set.tar.gz", [*members, bad], good)
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(archive))
    assert done.returncode == 1, done.stdout
    assert "cannot import" in done.stderr and "nothing was imported" in done.stderr
    assert objects(tmp_path / "pool") == []
    assert not (tmp_path / "escape.cubin").exists()


def test_a_directory_with_a_symlink_is_refused(tmp_path: Path, run: Run) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cubin").write_bytes(b"a")
    (src / "b.cubin").symlink_to("/etc/passwd")
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(src))
    assert done.returncode == 1 and "symbolic link" in done.stderr
    assert objects(tmp_path / "pool") == []


def test_an_unpacked_wheel_directory_imports_like_the_wheel(tmp_path: Path, run: Run) -> None:
    wheel = make_wheel(tmp_path / "w.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert pool_labels(run, tmp_path / "pool") == expected_labels()


def test_a_tarball_of_a_directory_made_with_dot_imports(tmp_path: Path, run: Run) -> None:
    # What "tar -C src -czf set.tgz ." writes: a "./" entry, then "./<pin>/...".
    wheel = make_wheel(tmp_path / "w.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    with tarfile.open(tmp_path / "set.tgz", "w:gz") as archive:
        archive.add(tmp_path / "site" / "flashinfer_cubin" / "cubins", arcname=".")
    with tarfile.open(tmp_path / "set.tgz") as archive:
        assert archive.getnames()[0] == "."
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(tmp_path / "set.tgz"))
    assert done.returncode == 0, done.stderr
    assert pool_labels(run, tmp_path / "pool") == expected_labels()


def test_export_tar_round_trips_into_a_fresh_pool(tmp_path: Path, run: Run) -> None:
    first, second = str(tmp_path / "one"), str(tmp_path / "two")
    assert run("--pool", first, "pool", "import",
               str(make_wheel(tmp_path / "w.whl"))).returncode == 0
    target = tmp_path / "out" / "set.tgz"
    target.parent.mkdir()
    done = run("--pool", first, "pool", "export", "--tar", str(target))
    assert done.returncode == 0, done.stderr
    assert [p.name for p in target.parent.iterdir()] == ["set.tgz"]  # no temp file left
    assert run("--pool", second, "pool", "import", str(target)).returncode == 0
    assert pool_labels(run, Path(second)) == expected_labels()


def test_export_tar_of_a_manifest_needs_every_artifact(tmp_path: Path, run: Run) -> None:
    pool = str(tmp_path / "pool")
    assert run("--pool", pool, "pool", "import",
               str(make_wheel(tmp_path / "w.whl"))).returncode == 0
    wanted = tmp_path / "m.txt"
    name = f"{PIN}/fmhaSm100aKernel_QBf16H128.cubin"
    wanted.write_text(f"{_sha(FILES['fmhaSm100aKernel_QBf16H128.cubin'])}  {name}\n")
    assert run("--pool", pool, "pool", "export", "--tar", str(tmp_path / "a.tar"),
               "--manifest", str(wanted)).returncode == 0
    with tarfile.open(tmp_path / "a.tar") as archive:
        assert archive.getnames() == ["checksums.txt", name]
    wanted.write_text(f"{'2' * 64}  not/in/pool.cubin\n")
    done = run("--pool", pool, "pool", "export", "--tar", str(tmp_path / "b.tar"),
               "--manifest", str(wanted))
    assert done.returncode == 1 and "not/in/pool.cubin" in done.stderr
    assert not (tmp_path / "b.tar").exists()
    assert list(tmp_path.glob(".b.tar*")) == []
    nowhere = run("--pool", pool, "pool", "export", "--tar", str(tmp_path / "no" / "c.tar"))
    assert nowhere.returncode == 1 and "is not a directory" in nowhere.stderr


def test_import_of_something_else_is_a_clear_error(tmp_path: Path, run: Run) -> None:
    odd = tmp_path / "notes.txt"
    odd.write_text("hello")
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(odd))
    assert done.returncode == 1
    assert "not a wheel (.whl), a tarball" in done.stderr
    missing = run("--pool", str(tmp_path / "pool"), "pool", "import", str(tmp_path / "nope.whl"))
    assert missing.returncode == 1 and "no such file or directory" in missing.stderr


def on_a_terminal(args: list[str], env: dict[str, str],
                  answer: bytes | None = None) -> tuple[int, bytes]:
    """Run ``python -m distcache ARGS`` on a pseudo-terminal of 120 columns; type
    ``answer`` once it asks a question."""
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: give the terminal a size, as a real one has
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.execvpe(sys.executable, [sys.executable, "-m", "distcache", *args], env)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if answer is not None and b"[y/N]" in out:
            os.write(fd, answer)
            answer = None
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def test_progress_shows_on_a_terminal_and_not_in_logs(tmp_path: Path, run: Run) -> None:
    wheel = make_wheel(tmp_path / "w.whl")
    logged = run("--pool", str(tmp_path / "one"), "pool", "import", str(wheel))
    assert logged.returncode == 0 and logged.stderr == ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env["PYTHONPATH"] = str(REPO)
    code, out = on_a_terminal(["--pool", str(tmp_path / "two"), "pool", "import", str(wheel)],
                               env)
    assert code == 0, out
    assert b"verifying" in out and b"importing" in out and b"imported 4 artifacts" in out

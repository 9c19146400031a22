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


def cli_runner(tmp_path: Path, **settings: str) -> Run:
    """Run ``python -m distcache ARGS`` with no DISTCACHE_* settings but ``settings``,
    and a private cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO), **settings})

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


def exported_set(tmp_path: Path, run: Run, name: str = "set.tar", count: int = 6,
                 size: int = 4000) -> Path:
    """A set of ``count`` random files and their checksums.txt, imported into a pool
    and exported from it as the tarball ``name``."""
    src = tmp_path / "src"
    (src / "pin").mkdir(parents=True)
    files = {f"pin/k{i}.cubin": os.urandom(size + i) for i in range(count)}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    (src / "checksums.txt").write_bytes(checksums(files))
    pool = str(tmp_path / "source-pool")
    assert run("--pool", pool, "pool", "import", str(src)).returncode == 0
    done = run("--pool", pool, "pool", "export", "--tar", str(tmp_path / name))
    assert done.returncode == 0, done.stderr
    return tmp_path / name


@pytest.mark.parametrize("damage", ["cut-at-a-header", "flipped-header-byte", "gzip-crc"])
def test_a_tarball_cut_short_or_damaged_is_refused(tmp_path: Path, run: Run,
                                                   damage: str) -> None:
    bundle = exported_set(tmp_path, run)
    with tarfile.open(bundle) as archive:
        fourth = archive.getmembers()[3].offset  # where the fourth member's header starts
    data = bytearray(bundle.read_bytes())
    if damage == "cut-at-a-header":
        data = data[:fourth]
    elif damage == "flipped-header-byte":
        data[fourth + 10] ^= 0x55
    else:
        import gzip

        data = bytearray(gzip.compress(bytes(data)))
        data[-8] ^= 0xFF  # the CRC-32 in the gzip trailer
        bundle = bundle.with_suffix(".tar.gz")
    bundle.write_bytes(bytes(data))
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(bundle))
    assert done.returncode == 1, done.stdout
    assert "not a readable tarball" in done.stderr and "nothing was imported" in done.stderr
    assert objects(tmp_path / "pool") == []
    assert pool_labels(run, tmp_path / "pool") == {}


def test_a_set_without_a_file_its_checksums_txt_lists_is_refused(tmp_path: Path,
                                                                 run: Run) -> None:
    bundle = exported_set(tmp_path, run)
    with tarfile.open(bundle) as archive, tarfile.open(tmp_path / "part.tar", "w") as part:
        for info in archive.getmembers():
            if info.name != "pin/k2.cubin":
                part.addfile(info, archive.extractfile(info))
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(tmp_path / "part.tar"))
    assert done.returncode == 1, done.stdout
    assert "pin/k2.cubin" in done.stderr and "cut short or incomplete" in done.stderr
    assert objects(tmp_path / "pool") == []


def test_a_member_larger_than_an_artifact_may_be_is_refused_before_it_is_read(
        tmp_path: Path, run: Run) -> None:
    good = b"kernel bytes\n"
    files = {"checksums.txt": checksums({"good.cubin": good}), "good.cubin": good,
             "padding.bin": bytes(64 << 10)}  # listed nowhere, so never imported
    bundle = _tar(tmp_path / "set.tar.gz", [_file(n, d) for n, d in files.items()], files)
    capped = cli_runner(tmp_path, DISTCACHE_MAX_ARTIFACT_BYTES="16K")
    done = capped("--pool", str(tmp_path / "pool"), "pool", "import", str(bundle))
    assert done.returncode == 1, done.stdout
    assert "'padding.bin' is 65536 bytes" in done.stderr
    assert "DISTCACHE_MAX_ARTIFACT_BYTES" in done.stderr and "nothing was imported" in done.stderr
    assert objects(tmp_path / "pool") == []
    # Under the default cap the same set imports, the unlisted member skipped.
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(bundle))
    assert done.returncode == 0, done.stderr
    assert pool_labels(run, tmp_path / "pool") == {"good.cubin": _sha(good)}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_export_stopped_by_a_signal_leaves_no_temp_file(tmp_path: Path, run: Run,
                                                           signum: int) -> None:
    # xz on random bytes runs at a few MB/s: the export is still writing when stopped.
    exported_set(tmp_path, run, count=8, size=3 << 20)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)})
    export = subprocess.Popen(
        [sys.executable, "-m", "distcache", "--pool", str(tmp_path / "source-pool"), "pool",
         "export", "--tar", str(out / "set.tar.xz")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(out.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p.name.startswith(".set.tar.xz.") for p in out.iterdir()] == [True]
    export.send_signal(signum)
    _, stderr = export.communicate(timeout=60)
    assert export.returncode == 128 + signum, stderr
    assert ("terminated" if signum == signal.SIGTERM else "interrupted") in stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("name", ["set.zip", "set.tar.zst", "set"])
def test_export_tar_refuses_a_suffix_import_cannot_read_back(tmp_path: Path, run: Run,
                                                             name: str) -> None:
    pool = str(tmp_path / "pool")
    assert run("--pool", pool, "pool", "import",
               str(make_wheel(tmp_path / "w.whl"))).returncode == 0
    out = tmp_path / "out"
    out.mkdir()
    done = run("--pool", pool, "pool", "export", "--tar", str(out / name))
    assert done.returncode == 2, done.stdout  # the option's value: bad usage
    assert "must end in one of .tar, .tar.gz, .tgz, .tar.bz2" in done.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("name", "magic"), [("set.tar.bz2", b"BZh"), ("set.tbz2", b"BZh"),
                                             ("set.txz", b"\xfd7zXZ"), ("set.tgz", b"\x1f\x8b")])
def test_export_tar_compresses_as_its_suffix_says(tmp_path: Path, run: Run, name: str,
                                                  magic: bytes) -> None:
    assert run("--pool", str(tmp_path / "one"), "pool", "import",
               str(make_wheel(tmp_path / "w.whl"))).returncode == 0
    done = run("--pool", str(tmp_path / "one"), "pool", "export", "--tar", str(tmp_path / name))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / name).read_bytes().startswith(magic)
    assert run("--pool", str(tmp_path / "two"), "pool", "import",
               str(tmp_path / name)).returncode == 0
    assert pool_labels(run, tmp_path / "two") == expected_labels()


def test_export_refuses_an_artifact_named_checksums_txt_at_the_top(tmp_path: Path,
                                                                   run: Run) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    files = {"checksums.txt": b"notes for the kernel set\n", "k.cubin": os.urandom(5000)}
    for name, data in files.items():
        (mirror / name).write_bytes(data)
    (tmp_path / "need.txt").write_bytes(checksums(files))
    pool = str(tmp_path / "pool")
    fetched = run("--pool", pool, "fetch", "--manifest", str(tmp_path / "need.txt"),
                  "--origin", str(mirror))
    assert fetched.returncode == 0, fetched.stderr
    assert set(pool_labels(run, Path(pool))) == {"checksums.txt", "k.cubin"}
    for target in (["--tar", str(tmp_path / "set.tar")], [str(tmp_path / "dir")]):
        done = run("--pool", pool, "pool", "export", *target)
        assert done.returncode == 1, done.stdout
        assert "cannot export an artifact named checksums.txt" in done.stderr
    assert not (tmp_path / "set.tar").exists() and not (tmp_path / "dir").exists()
    # Left out with --manifest, the rest exports and imports back.
    (tmp_path / "k.txt").write_bytes(checksums({"k.cubin": files["k.cubin"]}))
    done = run("--pool", pool, "pool", "export", "--tar", str(tmp_path / "set.tar"),
               "--manifest", str(tmp_path / "k.txt"))
    assert done.returncode == 0, done.stderr
    assert run("--pool", str(tmp_path / "two"), "pool", "import",
               str(tmp_path / "set.tar")).returncode == 0
    assert pool_labels(run, tmp_path / "two") == {"k.cubin": _sha(files["k.cubin"])}


def test_a_file_gone_between_the_passes_fails_the_import_with_no_label(tmp_path: Path) -> None:
    from distcache.errors import ConfigError
    from distcache.store import ArtifactPool
    from distcache.store._import import import_set

    src = tmp_path / "src"
    src.mkdir()
    files = {"a.cubin": b"a kernel", "b.cubin": b"b kernel"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "checksums.txt").write_bytes(checksums(files))

    class RemoveAfterVerifying:
        def phase(self, label: str, total_bytes: int | None) -> None:
            if label == "importing":  # the first pass has verified every file
                (src / "b.cubin").unlink()

        def advance(self, nbytes: int) -> None:
            pass

    pool = ArtifactPool(tmp_path / "pool")
    with pytest.raises(ConfigError, match=r"changed while being imported.*b\.cubin"):
        import_set(pool, src, RemoveAfterVerifying())
    assert pool.names() == {}


def test_an_encrypted_zip_member_is_refused(tmp_path: Path, run: Run) -> None:
    wheel = make_wheel(tmp_path / "w.whl")
    data = bytearray(wheel.read_bytes())
    # Set the "encrypted" flag of the last member in its local and central headers.
    for signature, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.rfind(signature) + offset
        data[at] |= 0x01
    wheel.write_bytes(bytes(data))
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(wheel))
    assert done.returncode == 1, done.stdout
    assert "is encrypted" in done.stderr and "nothing was imported" in done.stderr
    assert "internal error" not in done.stderr
    assert objects(tmp_path / "pool") == []


def test_a_pipe_is_refused_as_not_a_regular_file(tmp_path: Path, run: Run) -> None:
    fifo = tmp_path / "set.tar"
    os.mkfifo(fifo)
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", str(fifo))
    assert done.returncode == 1
    assert "not a regular file or directory" in done.stderr
    assert "no such file" not in done.stderr

"""Edges of the launch wrapper, ``pool verify`` and manifest reading that a user meets
by accident: an empty ``--pool ""`` (an unset shell variable), Ctrl-C or SIGTERM while
the wrapper prefetches, an object's name that holds no regular file, a name or a line
that is megabytes long, and a manifest path that is a device."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distcache import artifact as artifact_module
from distcache.artifact import (
    Artifact,
    check_sha256,
    parse_checksums,
    read_manifest,
    validate_name,
)
from distcache.errors import ArtifactNameError, ConfigError, ManifestError
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.cli import cli_env, signal_mid_download
from tests.support.process import run_group

PY = sys.executable
LAUNCH = [PY, "-m", "launch"]
DISTCACHE = [PY, "-m", "distcache"]
# Variables by which a launcher (or a job the tests run in) would make the wrapper a
# rank of a larger job: the wrapper here runs alone.
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The command's environment: no ``DISTCACHE_*`` settings, no launcher."""
    clean = cli_env(tmp_path)
    return {k: v for k, v in clean.items()
            if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``cmd`` in its own session; its whole process group is killed at ``timeout``."""
    return run_group(cmd, timeout=timeout, env=env, cwd=cwd)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _one_error_line(done: subprocess.CompletedProcess[str], program: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{program}: error: "), done.stderr
    return lines[0]


# --- 1. an empty --pool ------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--pool", "--workspace", "--materialize"])
def test_launch_refuses_an_empty_directory_option(
    tmp_path: Path, env: dict[str, str], option: str
) -> None:
    served = tmp_path / "origin"
    make_artifacts(served, 2, min_size=100, max_size=200, seed=3)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env["DISTCACHE_ORIGIN"] = str(served)
    for extra in ([], ["--prefetch", str(served / "checksums.txt")]):
        done = _run([*LAUNCH, option, "", *extra, "--", "true"], env, cwd=cwd)
        assert done.returncode == 2, (extra, done.stdout, done.stderr)
        line = _one_error_line(done, "python -m launch")
        assert f"argument {option}: empty directory name" in line
        # Nothing was made in the directory the empty name would have meant.
        assert list(cwd.iterdir()) == [], extra


# --- 2. Ctrl-C and SIGTERM during the wrapper's prefetch; exit codes ---------------------


@pytest.mark.parametrize(("sig", "status", "word"), [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 143, "terminated"),
])
def test_a_signal_during_the_launch_prefetch_exits_with_one_line_and_no_temp_files(
    tmp_path: Path, env: dict[str, str], sig: signal.Signals, status: int, word: str
) -> None:
    served = tmp_path / "origin"
    make_artifacts(served, 20, min_size=200_000, max_size=300_000, seed=5)
    pool = tmp_path / "pool"
    marker = tmp_path / "program-ran"
    # 200 kB/s for ~5 MB: the whole prefetch would take about 25 s.
    with LoopbackOrigin(served, bandwidth=200_000) as origin:
        env["DISTCACHE_ORIGIN"] = origin.url
        returncode, _, stderr = signal_mid_download(
            [*LAUNCH, "--pool", str(pool), "--prefetch", str(served / "checksums.txt"),
             "--", "touch", str(marker)], env, pool, sig)
    assert returncode == status, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == f"python -m launch: {word}", stderr
    assert list((pool / "tmp").iterdir()) == []
    assert not marker.exists(), "the program ran after the set-up was stopped"


def test_launch_exits_1_for_a_runtime_error_and_2_for_bad_usage(
    tmp_path: Path, env: dict[str, str]
) -> None:
    served = tmp_path / "origin"
    make_artifacts(served, 2, min_size=100, max_size=200, seed=4)
    manifest = str(served / "checksums.txt")
    pool = str(tmp_path / "pool")
    # No origin, and no pool holds the artifacts: a runtime error, not bad usage.
    done = _run([*LAUNCH, "--pool", pool, "--prefetch", manifest, "--", "true"], env)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the progress lines
    assert last.startswith("python -m launch: error: "), done.stderr
    assert "are in no pool" in last
    # Linking into a directory under a file cannot work.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    done = _run([*LAUNCH, "--pool", pool, "--prefetch", manifest, "--materialize",
                 str(blocker / "sub"), "--", "true"], {**env, "DISTCACHE_ORIGIN": str(served)})
    assert done.returncode == 1, done.stderr
    assert "cannot materialize" in done.stderr.strip().splitlines()[-1], done.stderr
    # One that is a file is bad usage, said before anything runs.
    done = _run([*LAUNCH, "--pool", pool, "--prefetch", manifest, "--materialize",
                 str(blocker), "--", "true"], {**env, "DISTCACHE_ORIGIN": str(served)})
    assert done.returncode == 2, done.stderr
    assert f"--materialize {blocker}: not a directory" in done.stderr, done.stderr
    # Bad usage, and a launcher environment that contradicts itself, stay 2.
    done = _run([*LAUNCH, "--materialize", str(tmp_path), "--", "true"], env)
    assert done.returncode == 2, done.stderr
    for given, said in ((tmp_path, "not a file"), (tmp_path / "absent.txt", "no such file")):
        done = _run([*LAUNCH, "--prefetch", str(given), "--", "true"], env)
        assert done.returncode == 2, done.stderr
        assert f"--prefetch {given}: {said}" in done.stderr, done.stderr
    conflicting = {**env, "RANK": "1", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
                   "OMPI_COMM_WORLD_SIZE": "4"}
    done = _run([*LAUNCH, "--", "true"], conflicting)
    assert done.returncode == 2, done.stderr


# --- 3. an object's name that holds no regular file ---------------------------------------


def _pool_with(tmp_path: Path, count: int) -> tuple[ArtifactPool, list[Artifact]]:
    pool = ArtifactPool(tmp_path / "pool")
    artifacts = []
    for i in range(count):
        sha = pool.put(b"object %d " % i * 100)
        artifacts.append(Artifact(f"kernels/k{i}.cubin", sha))
    pool.remember(artifacts)
    return pool, artifacts


def test_verify_quarantines_objects_that_are_not_regular_files(tmp_path: Path) -> None:
    pool, artifacts = _pool_with(tmp_path, 5)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "passwd"
    secret.write_text("root:x:0:0\n")
    paths = [Path(pool.layout.object_path(a.sha256)) for a in artifacts]
    for path in paths[:4]:
        path.unlink()
    paths[0].mkdir()
    (paths[0] / "inside").write_text("kept")
    paths[1].symlink_to(secret)
    paths[2].symlink_to(outside, target_is_directory=True)
    os.mkfifo(paths[3])

    report = pool.verify()

    assert (report.ok, report.corrupt) == (1, 4)
    assert report.quarantined == 4
    for path in paths[:4]:
        assert not os.path.lexists(path)
    # Moved aside, never followed nor deleted: what the links pointed at is untouched,
    # and the directory went to quarantine/ whole.
    assert secret.read_text() == "root:x:0:0\n"
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]
    kinds = sorted(stat.S_IFMT(p.lstat().st_mode) for p in pool.layout.quarantine.iterdir())
    assert kinds == sorted([stat.S_IFDIR, stat.S_IFLNK, stat.S_IFLNK, stat.S_IFIFO])
    inside = [p / "inside" for p in pool.layout.quarantine.iterdir() if p.is_dir()
              and not p.is_symlink()]
    assert [p.read_text() for p in inside] == ["kept"]
    # A second scan finds the pool whole (what was lacking is fetched again when needed).
    again = pool.verify()
    assert (again.ok, again.corrupt) == (1, 0)


def test_pool_verify_command_fails_on_a_symlinked_object(
    tmp_path: Path, env: dict[str, str]
) -> None:
    pool, artifacts = _pool_with(tmp_path, 2)
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0\n")
    path = Path(pool.layout.object_path(artifacts[0].sha256))
    path.unlink()
    path.symlink_to(target)
    done = _run([*DISTCACHE, "--pool", str(pool.root), "pool", "verify"], env)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "1 ok" in done.stdout and "1 corrupt" in done.stdout, done.stdout
    assert not os.path.lexists(path)
    assert target.read_text() == "root:x:0:0\n"


# --- 4. names and lines too long to quote whole -------------------------------------------


LONG = "a" * 100_000
SHA = "0" * 64


def test_a_huge_name_is_cut_in_messages() -> None:
    with pytest.raises(ArtifactNameError) as caught:
        validate_name(LONG)
    assert len(str(caught.value)) < 300
    assert "100000 characters" in str(caught.value)
    assert getattr(caught.value, "name", None) == LONG  # the attribute keeps it whole
    with pytest.raises(ArtifactNameError) as caught:
        parse_checksums(f"{SHA}  {LONG}\n", source="m/long.txt")
    assert len(str(caught.value)) < 300
    assert str(caught.value).startswith("m/long.txt:1: artifact name 'aaa")
    with pytest.raises(ManifestError) as malformed:
        parse_checksums(f"nothex  {LONG}\n")
    assert len(str(malformed.value)) < 300
    with pytest.raises(ValueError) as digest:
        check_sha256(LONG)
    assert len(str(digest.value)) < 300


def test_fetch_with_a_huge_name_prints_one_short_line(
    tmp_path: Path, env: dict[str, str]
) -> None:
    manifest = tmp_path / "long.txt"
    manifest.write_text(f"{SHA}  {LONG}\n")
    done = _run([*DISTCACHE, "--pool", str(tmp_path / "pool"), "fetch", "--manifest",
                 str(manifest), "--origin", str(tmp_path)], env)
    assert done.returncode == 1, done.stderr[:500]
    line = _one_error_line(done, "distcache")
    assert len(line) < 500, len(line)
    assert "longer than 1024 bytes" in line


# --- 5. a manifest path that is a device or far too big -----------------------------------


def test_a_manifest_over_the_limit_is_refused_naming_file_and_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifact_module, "MAX_MANIFEST_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text(f"{SHA}  kernels/a.cubin\n" * 40)  # about 3 kB
    with pytest.raises(ConfigError) as caught:
        read_manifest(big)
    assert str(big) in str(caught.value) and "1000 bytes" in str(caught.value)
    # At the limit it is read.
    exact = tmp_path / "exact.txt"
    exact.write_text(f"{SHA}  kernels/a.cubin\n".ljust(1000, "\n"))
    assert [a.name for a in read_manifest(exact)] == ["kernels/a.cubin"]


def test_a_stream_manifest_is_read_no_further_than_the_limit(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifact_module, "MAX_MANIFEST_BYTES", 1000)
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"#" * 5000)
        os.close(write_end)
        write_end = -1
        with pytest.raises(ConfigError) as caught:
            read_manifest(f"/proc/self/fd/{read_end}")
        assert "1000 bytes" in str(caught.value)
        os.set_blocking(read_end, False)
        left = len(os.read(read_end, 10_000))
        assert left == 5000 - 1001  # the limit and one byte more were read, no further
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def _small_address_space() -> None:
    # An unbounded read of /dev/zero fails here in a second, not after filling memory.
    limit = 2 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_fetch_from_dev_zero_is_one_line_naming_the_limit(
    tmp_path: Path, env: dict[str, str]
) -> None:
    proc = subprocess.Popen(
        [*DISTCACHE, "--pool", str(tmp_path / "pool"), "fetch", "--manifest", "/dev/zero",
         "--origin", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_small_address_space,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        proc.wait()
    assert proc.returncode == 1, stderr
    line = stderr.strip()
    assert "\n" not in line and "MemoryError" not in line, line
    assert "/dev/zero" in line and str(artifact_module.MAX_MANIFEST_BYTES) in line, line


def test_the_start_ups_own_reads_of_a_manifest_are_bounded_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """init reads a manifest before the prefetch does (is anything lacking; the key of
    its inputs): a stream such as /dev/zero counts as unreadable there, read no
    further than the limit, and the prefetch then says why."""
    from distcache import _prepare
    from distcache.store import ArtifactPool

    monkeypatch.setattr(_prepare, "MAX_MANIFEST_BYTES", 1000)
    pool = ArtifactPool(tmp_path / "pool")
    assert _prepare.lacks_any(pool, ["/dev/zero"], ()) is True
    assert _prepare.inputs_key(["/dev/zero"], None, False) is None
    small = tmp_path / "m.txt"
    small.write_text("")
    assert _prepare.lacks_any(pool, [str(small)], ()) is False
    assert _prepare.inputs_key([str(small)], None, False) is not None


def test_a_sigterm_during_the_launchers_clean_up_lets_it_finish(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGTERM while a failed set-up is undone (the peers' agent closing, MPI's
    finalize) is noted, not raised there: the clean-up ends, then the wrapper exits
    143 with one line."""
    import launch.__main__ as wrapper

    monkeypatch.setattr(wrapper, "_UNWINDS", [True, False])
    closed: list[bool] = []

    class Agent:
        def close(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the close
            time.sleep(0.05)
            closed.append(True)

    previous = signal.signal(signal.SIGTERM, wrapper._terminate)
    try:
        with pytest.raises(SystemExit) as done:
            wrapper._fail(1, "python -m launch: error: no pool", Agent())  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert closed == [True]
    assert done.value.code == 143
    assert capsys.readouterr().err.splitlines() == [
        "python -m launch: error: no pool", "python -m launch: terminated"]

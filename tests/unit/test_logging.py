"""Logging as the programs configure it: rank 0's progress by default, every rank's
with -v, each line once (``distcache._logging`` and ``distcache prefetch`` under
``mpirun -n 2``)."""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache._logging import configure_logging
from distcache.testing import make_artifacts
from tests.support.process import mpirun, run_group

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("distcache.collective._run")


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    yield io.StringIO()


def _configured(stream: io.StringIO, verbose: int, rank: int | None) -> list[str]:
    restore = configure_logging(verbose, rank, stream=stream)
    try:
        log.info("download: 3 artifacts")
        log.debug("bucket 1 of 2")
        log.warning("origin is slow")
    finally:
        restore()
    return stream.getvalue().splitlines()


def test_rank_0_prints_progress_and_other_ranks_only_warnings(stream: io.StringIO) -> None:
    assert _configured(stream, 0, 0) == ["distcache: download: 3 artifacts",
                                         "distcache: rank 0: WARNING: origin is slow"]
    assert _configured(io.StringIO(), 0, 1) == ["distcache: rank 1: WARNING: origin is slow"]


def test_verbose_prints_every_ranks_progress_and_debug_tagged(stream: io.StringIO) -> None:
    assert _configured(stream, 1, 1) == ["distcache: rank 1: download: 3 artifacts",
                                         "distcache: rank 1: DEBUG: bucket 1 of 2",
                                         "distcache: rank 1: WARNING: origin is slow"]


def test_a_command_outside_a_job_prints_only_warnings(stream: io.StringIO) -> None:
    assert _configured(stream, 0, None) == ["distcache: WARNING: origin is slow"]


def test_a_line_is_printed_once_when_the_application_also_logs(
    stream: io.StringIO, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    theirs = logging.StreamHandler(sys.stdout)
    root.addHandler(theirs)
    try:
        lines = _configured(stream, 0, 0)
    finally:
        root.removeHandler(theirs)
    assert lines.count("distcache: download: 3 artifacts") == 1
    assert "download: 3 artifacts" not in capsys.readouterr().out


def test_configuring_again_replaces_and_restore_undoes_everything(stream: io.StringIO) -> None:
    logger = logging.getLogger("distcache")
    before = (logger.level, logger.propagate, list(logger.handlers))
    restore = configure_logging(0, None, stream=stream)
    configure_logging(0, 0, stream=stream)  # the CLI, once it knows its rank
    assert len(logger.handlers) == 1
    log.info("once")
    restore()
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    assert stream.getvalue().splitlines() == ["distcache: once"]


def _mpi_prefetch(tmp_path: Path, *flags: str) -> tuple[str, str]:
    origin = tmp_path / "origin"
    make_artifacts(origin, 4, min_size=1_000, max_size=4_000, seed=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCACHE_", "OMPI_", "PMIX"))}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    done = run_group(
        [mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m", "distcache",
         "--pool", str(tmp_path / "pool"), *flags, "prefetch",
         "--manifest", str(origin / "checksums.txt"), "--origin", str(origin)],
        timeout=180, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr


@pytest.mark.timeout(240)
def test_cli_prefetch_under_mpirun_prints_each_phase_once_from_rank_0(tmp_path: Path) -> None:
    stdout, stderr = _mpi_prefetch(tmp_path)
    lines = stderr.splitlines()
    assert sum(line.startswith("distcache: comm: mpi backend, 2 rank(s)") for line in lines) == 1
    assert sum(line.startswith("distcache: pool: ") for line in lines) == 1
    assert "rank 1" not in stderr
    assert stdout.count("prefetch: 4 artifacts") == 1  # the summary, on stdout, once
    assert "prefetch: prefetch:" not in stdout + stderr


@pytest.mark.timeout(240)
def test_cli_prefetch_under_mpirun_with_verbose_prints_every_rank(tmp_path: Path) -> None:
    _stdout, stderr = _mpi_prefetch(tmp_path, "-v")
    for rank in (0, 1):
        tagged = [line for line in stderr.splitlines()
                  if line.startswith(f"distcache: rank {rank}: comm: ")]
        assert len(tagged) == 1, stderr


def test_init_logs_the_prefetch_summary_once_without_a_doubled_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: io.StringIO
) -> None:
    import distcache
    from distcache.artifact import manifest_text

    for var in [v for v in os.environ if v.startswith("DISTCACHE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    artifacts = make_artifacts(tmp_path / "origin", 3, min_size=500, max_size=900, seed=4)
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(manifest_text(artifacts))
    restore = configure_logging(0, 0, stream=stream)
    try:
        with distcache.init(pool=tmp_path / "pool", origin=str(tmp_path / "origin"),
                            manifests=[manifest], integrations=()):
            pass
    finally:
        restore()
    lines = stream.getvalue().splitlines()
    summaries = [line for line in lines if "3 artifacts (" in line]
    assert summaries == [next(line for line in lines if line.startswith("distcache: prefetch: 3"))]
    assert not any("prefetch: prefetch:" in line for line in lines)
    assert sum(line.startswith("distcache: pool: ") for line in lines) == 1


def _mpi_launch(tmp_path: Path, *flags: str) -> str:
    origin = tmp_path / "origin"
    make_artifacts(origin, 4, min_size=1_000, max_size=4_000, seed=7)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCACHE_", "OMPI_", "PMIX"))}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               DISTCACHE_ORIGIN=str(origin), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    done = run_group(
        [mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m", "launch", *flags,
         "--pool", str(tmp_path / "pool"), "--prefetch", str(origin / "checksums.txt"),
         "--", sys.executable, "-c", "pass"],
        timeout=180, env=env, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stderr


@pytest.mark.timeout(240)
def test_launch_prefetch_under_mpirun_prints_the_summary_once_from_rank_0(
    tmp_path: Path,
) -> None:
    stderr = _mpi_launch(tmp_path)
    assert stderr.count("prefetch: 4 artifacts") == 1, stderr
    assert "prefetch: prefetch:" not in stderr
    assert "rank 1" not in stderr
    verbose = _mpi_launch(tmp_path / "v", "-v")
    assert "distcache: rank 1: " in verbose and "distcache: rank 0: " in verbose
    # Every rank's summary, each once (rank 0's is not repeated as a debug line).
    for rank in (0, 1):
        assert sum(f"rank {rank}: " in line and "prefetch: 4 artifacts" in line
                   for line in verbose.splitlines()) == 1, verbose


def test_an_error_every_rank_raised_is_printed_by_rank_0_only() -> None:
    from distcache._logging import configure_logging, error_line
    from distcache.errors import ConfigError

    agreed, own = ConfigError("3 artifact(s) are in no pool"), ConfigError("bad setting")
    agreed.agreed = True
    for rank, verbose, shown in [(0, 0, True), (1, 0, False), (1, 1, True), (None, 0, True)]:
        restore = configure_logging(verbose, rank)
        try:
            line = error_line("prog", agreed)
            assert (line == "prog: error: 3 artifact(s) are in no pool") is shown, (rank, verbose)
            # An error of this rank's own is printed wherever it happened.
            assert error_line("prog", own) == "prog: error: bad setting"
        finally:
            restore()
    # An explicit rank wins over the configured one (the CLI's, once logging is undone).
    assert error_line("prog", agreed, rank=2) is None

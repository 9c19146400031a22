"""Edges of the ``distcache`` command: counts that match what happened, bad option
values, directories that are not pools, and failures that leave nothing half-done."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from distcache.artifact import parse_checksums
from distcache.cli import main
from distcache.testing import make_artifacts
from tests.support.cli import cli_env, run_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path)


distcache = run_cli


@pytest.fixture
def served(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    make_artifacts(root, 4, min_size=2_000, max_size=8_000, seed=3)
    return root


@pytest.fixture
def pool(tmp_path: Path, env: dict[str, str], served: Path) -> Path:
    root = tmp_path / "pool"
    done = distcache(env, "--pool", str(root), "pool", "import", str(served))
    assert done.returncode == 0, done.stderr
    return root


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- counts -----------------------------------------------------------------------------


def test_fetch_counts_one_download_for_two_names_of_one_object(
    tmp_path: Path, env: dict[str, str], served: Path
) -> None:
    listed = parse_checksums((served / "checksums.txt").read_text())
    manifest = tmp_path / "aliases.txt"
    # The second name is not on the origin: only a pool hit can satisfy it.
    manifest.write_text((served / "checksums.txt").read_text()
                        + f"{listed[0].sha256}  alias/only-in-pool.cubin\n")
    done = distcache(env, "--pool", str(tmp_path / "pool"), "fetch", "--manifest",
                     str(manifest), "--origin", str(served), "--json", "--jobs", "1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    size = sum((served / a.name).stat().st_size for a in listed)
    assert report["artifacts"] == 5 and report["fetched"] == 5
    assert report["downloaded"] == 4 and report["downloaded_bytes"] == size
    assert report["already_present"] == 1


# --- nothing half-written ---------------------------------------------------------------


def test_export_to_a_directory_with_an_absent_artifact_writes_nothing(
    tmp_path: Path, env: dict[str, str], served: Path, pool: Path
) -> None:
    manifest = tmp_path / "want.txt"
    manifest.write_text((served / "checksums.txt").read_text() + "f" * 64 + "  zz/absent.cubin\n")
    target = tmp_path / "mirror"
    done = distcache(env, "--pool", str(pool), "pool", "export", str(target),
                     "--manifest", str(manifest))
    assert done.returncode == 1
    assert "zz/absent.cubin" in done.stderr and "Traceback" not in done.stderr
    assert not target.exists()


# --- directories that are not pools -----------------------------------------------------


@pytest.mark.parametrize("command", [
    ["pool", "ls"], ["pool", "stats"], ["pool", "verify"], ["pool", "gc", "--max-bytes", "1M"],
    ["pool", "rm", "*", "--dry-run"], ["pool", "prune", "--older-than", "1d", "--dry-run"],
    ["pool", "export", "--tar", "OUT/x.tar"],
])
def test_a_directory_with_objects_that_is_not_a_pool_is_refused_untouched(
    tmp_path: Path, env: dict[str, str], command: list[str]
) -> None:
    # A git directory has objects/ too; it is no pool and must not become one.
    foreign = tmp_path / "repo.git"
    (foreign / "objects" / "ab").mkdir(parents=True)
    (foreign / "objects" / "ab" / ("c" * 38)).write_bytes(b"git object")
    (foreign / "HEAD").write_text("ref: refs/heads/main\n")
    before = _tree(foreign)
    args = [a.replace("OUT", str(tmp_path)) for a in command]
    done = distcache(env, "--pool", str(foreign), *args)
    assert done.returncode == 1, done.stdout
    assert "not a distcache pool" in done.stderr and "Traceback" not in done.stderr
    assert _tree(foreign) == before


@pytest.mark.parametrize("command", [
    ["fetch", "--manifest", "SET/checksums.txt", "--origin", "SET"], ["pool", "import", "SET"],
    ["prefetch", "--manifest", "SET/checksums.txt", "--origin", "SET"],
])
def test_fetch_and_import_do_not_write_into_a_directory_that_is_not_a_pool(
    tmp_path: Path, env: dict[str, str], served: Path, command: list[str]
) -> None:
    foreign = tmp_path / "repo.git"
    (foreign / "objects").mkdir(parents=True)
    before = _tree(foreign)
    done = distcache(env, "--pool", str(foreign), *[a.replace("SET", str(served)) for a in command])
    assert done.returncode == 1, done.stdout
    assert "not a distcache pool" in done.stderr
    assert _tree(foreign) == before


def test_dry_run_and_doctor_do_not_take_a_foreign_directory_for_a_pool(
    tmp_path: Path, env: dict[str, str], served: Path
) -> None:
    foreign = tmp_path / "repo.git"
    (foreign / "objects").mkdir(parents=True)
    before = _tree(foreign)
    dry = distcache(env, "--pool", str(foreign), "prefetch", "--manifest",
                    str(served / "checksums.txt"), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["exists"] is False
    doctor = distcache(env, "--pool", str(foreign), "doctor", "--json")
    assert doctor.returncode == 0, doctor.stderr
    assert "not created yet" in json.loads(doctor.stdout)["pool"]
    assert _tree(foreign) == before


# --- bad option values ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_prefetch_refuses_a_timeout_that_is_not_a_positive_number(
    tmp_path: Path, env: dict[str, str], served: Path, value: str
) -> None:
    done = distcache(env, "--pool", str(tmp_path / "pool"), "prefetch", "--manifest",
                     str(served / "checksums.txt"), "--origin", str(served),
                     f"--timeout={value}")
    assert done.returncode == 2, done.stdout
    assert "--timeout" in done.stderr
    assert not (tmp_path / "pool").exists()


def test_dry_run_refuses_a_record_directory_that_does_not_exist(
    tmp_path: Path, env: dict[str, str]
) -> None:
    done = distcache(env, "--pool", str(tmp_path / "pool"), "prefetch", "--flashinfer",
                     "--record", str(tmp_path / "no-such-record"), "--dry-run")
    assert done.returncode == 1, done.stdout
    assert "no-such-record" in done.stderr and "no such directory" in done.stderr


@pytest.mark.parametrize("command", [
    ["pool", "ls", "--family", "inductr"], ["pool", "export", "OUT", "--family", "inductr"],
    ["pool", "export", "--tar", "OUT.tar", "--family", "inductr"],
])
@pytest.mark.parametrize("held", [True, False], ids=["pool", "no-pool"])
def test_an_unknown_jit_family_is_refused(
    tmp_path: Path, env: dict[str, str], pool: Path, command: list[str], held: bool
) -> None:
    # Bad usage whatever the pool: also where there is none yet.
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    done = distcache(env, "--pool", str(pool if held else tmp_path / "absent"), *args)
    assert done.returncode == 2, done.stdout  # an option's value: bad usage
    assert "inductr" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tar").exists()


# --- --json stays one document ----------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rm_json_on_a_terminal_asks_on_stderr_and_prints_only_json(
    pool: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DISTCACHE_POOL", raising=False)
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code = main(["--pool", str(pool), "pool", "rm", "*", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["labels_removed"] == 4
    assert "[y/N]" in err


# --- a pool is not an artifact set ------------------------------------------------------


def test_import_of_a_pool_directory_is_refused_and_adds_nothing(
    tmp_path: Path, env: dict[str, str], pool: Path
) -> None:
    other = tmp_path / "other"
    done = distcache(env, "--pool", str(other), "pool", "import", str(pool))
    assert done.returncode == 1, done.stdout
    assert "is a distcache pool" in done.stderr and "pool export" in done.stderr
    assert not other.exists()


@pytest.mark.parametrize("where", [".", "mirror"])
def test_export_into_the_pool_itself_is_refused(
    env: dict[str, str], pool: Path, where: str
) -> None:
    before = _tree(pool)
    done = distcache(env, "--pool", str(pool), "pool", "export", str(pool / where))
    assert done.returncode == 1, done.stdout
    assert "inside the pool" in done.stderr
    assert _tree(pool) == before


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_empty_pool_option_is_refused_rather_than_taken_for_the_current_directory(
    tmp_path: Path, env: dict[str, str], served: Path, where: str
) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    fetch = ["fetch", "--manifest", str(served / "checksums.txt"), "--origin", str(served)]
    args = ["--pool", "", *fetch] if where == "before" else [*fetch, "--pool", ""]
    done = subprocess.run([sys.executable, "-m", "distcache", *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=cwd, check=False)
    assert done.returncode == 2, done.stdout
    assert "--pool" in done.stderr
    assert list(cwd.iterdir()) == []

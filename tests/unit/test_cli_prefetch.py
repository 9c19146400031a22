"""``distcache prefetch --dry-run``, ``--arch`` and ``--json`` through the real command
line, and the architecture rule ``--arch`` applies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distcache import cli
from distcache.artifact import sha256_hex
from distcache.errors import ConfigError
from distcache.integrations.flashinfer import _warm as warm
from distcache.integrations.flashinfer._warm import arch_filter, parse_arch
from distcache.store import ArtifactPool
from tests.unit.test_pool_import import (
    PIN,
    Run,
    cli_runner,
    make_wheel,
    objects,
    pool_labels,
)


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return cli_runner(tmp_path)


def _half_pool(tmp_path: Path, run: Run, artifact_dir: Path) -> tuple[Path, Path]:
    """A pool holding the artifacts of one manifest, and a manifest of twice as many."""
    pool = tmp_path / "pool"
    lines = (artifact_dir / "checksums.txt").read_text().splitlines()
    first = tmp_path / "first"
    first.mkdir()
    for line in lines[: len(lines) // 2]:
        name = line.split(None, 1)[1]
        (first / name).parent.mkdir(parents=True, exist_ok=True)
        (first / name).write_bytes((artifact_dir / name).read_bytes())
    assert run("--pool", str(pool), "pool", "import", str(first)).returncode == 0
    return pool, artifact_dir / "checksums.txt"


def test_dry_run_lists_what_the_pool_lacks_and_downloads_nothing(
    tmp_path: Path, run: Run, artifact_dir: Path
) -> None:
    pool, manifest = _half_pool(tmp_path, run, artifact_dir)
    before = objects(pool)
    total = len(manifest.read_text().splitlines())
    done = run("--pool", str(pool), "prefetch", "--manifest", str(manifest), "--dry-run",
               "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["artifacts"] == total and len(report["missing"]) == total - total // 2
    assert not set(pool_labels(run, pool)) & {m["name"] for m in report["missing"]}
    text = run("--pool", str(pool), "prefetch", "--manifest", str(manifest), "--dry-run")
    assert f"lacks {total - total // 2} of {total} artifacts" in text.stdout
    assert objects(pool) == before


def test_dry_run_on_a_missing_pool_lacks_everything_and_creates_nothing(
    tmp_path: Path, run: Run, artifact_dir: Path
) -> None:
    done = run("--pool", str(tmp_path / "none"), "prefetch", "--manifest",
               str(artifact_dir / "checksums.txt"), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "(no pool yet) lacks 8 of 8" in done.stdout
    assert not (tmp_path / "none").exists()


def test_dry_run_of_a_family_whose_manifest_is_not_pooled_says_so(tmp_path: Path,
                                                                  run: Run) -> None:
    pytest.importorskip("flashinfer.artifacts")
    done = run("--pool", str(tmp_path / "pool"), "prefetch", "--flashinfer", "--family",
               "TRTLLM_GEN_FMHA", "--arch", "sm_90", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["families_not_expanded"] == ["TRTLLM_GEN_FMHA"]
    assert [m["name"].rsplit("/", 1)[1] for m in report["missing"]] == ["checksums.txt"]


def test_prefetch_json_reports_the_collective(tmp_path: Path, run: Run, artifact_dir: Path) -> None:
    done = run("--pool", str(tmp_path / "pool"), "prefetch", "--manifest",
               str(artifact_dir / "checksums.txt"), "--origin", str(artifact_dir), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["artifacts"] == 8 and report["downloads"] == 8 and report["summary"]


def test_arch_without_a_family_and_a_bad_arch_are_refused(tmp_path: Path, run: Run,
                                                          artifact_dir: Path) -> None:
    manifest = str(artifact_dir / "checksums.txt")
    done = run("--pool", str(tmp_path / "p"), "prefetch", "--manifest", manifest,
               "--arch", "sm_90")
    assert done.returncode == 2 and "--arch filters whole families" in done.stderr
    bad = run("--pool", str(tmp_path / "p"), "pool", "import", "--arch", "hopper",
              str(artifact_dir))
    assert bad.returncode == 2 and "bad GPU architecture 'hopper'" in bad.stderr


def test_import_with_arch_keeps_what_those_gpus_load(tmp_path: Path, run: Run) -> None:
    wheel = make_wheel(tmp_path / "w.whl")
    done = run("--pool", str(tmp_path / "pool"), "pool", "import", "--arch", "sm_90",
               str(wheel))
    assert done.returncode == 0, done.stderr
    assert "1 files for other architectures left out" in done.stdout
    assert set(pool_labels(run, tmp_path / "pool")) == {
        f"{PIN}/checksums.txt", f"{PIN}/include/flashInferMetaInfo.h",
        f"{PIN}/fmhaSm90aKernel_QBf16H128.cubin"}


@pytest.mark.parametrize(("text", "cc"), [("sm_90", 90), ("sm_100a", 100), ("SM100", 100),
                                          ("103", 103), ("9.0", 90), ("12.0", 120)])
def test_parse_arch_accepts_the_usual_spellings(text: str, cc: int) -> None:
    assert parse_arch(text) == cc


@pytest.mark.parametrize("text", ["hopper", "sm_", "sm_9", "", "90x"])
def test_parse_arch_refuses_anything_else(text: str) -> None:
    with pytest.raises(ConfigError, match="bad GPU architecture"):
        parse_arch(text)


@pytest.mark.parametrize(("name", "archs", "kept"), [
    ("pin/fmha/fmhaSm100aKernel_X.cubin", ["sm_100"], True),
    ("pin/fmha/fmhaSm100aKernel_X.cubin", ["sm_103"], False),  # 'a': that architecture only
    ("pin/gemm/Gemm_X_sm100f.cubin", ["sm_103"], True),  # 'f': the later ones of the family
    ("pin/gemm/Gemm_X_sm100f.cubin", ["sm_90"], False),
    ("pin/gemm/Gemm_X_sm100f.cubin", ["sm_110"], False),  # another major version
    ("pin/fmha/cute-dsl/x86_64/sm_103a/checksums.txt", ["sm_100"], False),
    ("pin/fmha/cute-dsl/x86_64/sm_103a/checksums.txt", ["sm_90", "sm_103"], True),
    ("pin/deep-gemm/kernel.fp8_m_grouped_gemm.007404769193.cubin", ["sm_100"], True),
    ("pin/gemm/include/flashinferMetaInfo.h", ["sm_90"], True),
    ("pin/fmha/fmhaSm100aKernel_X.cubin", [], True),
])
def test_arch_filter_follows_the_documented_rule(name: str, archs: list[str], kept: bool) -> None:
    assert arch_filter(archs)(name) is kept


def test_family_prefetch_with_arch_fetches_only_what_those_gpus_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [k for k in os.environ if k.startswith("DISTCACHE_")]:
        monkeypatch.delenv(name)
    files = {"fmhaSm100aKernel_X.cubin": b"sm100a", "Gemm_X_sm100f.cubin": b"sm100f",
             "fmhaSm90aKernel_X.cubin": b"sm90a", "include/flashinferMetaInfo.h": b"h"}
    listing = "".join(f"{sha256_hex(d)}  {n}\n" for n, d in files.items()).encode()
    mirror = tmp_path / "mirror" / "pin" / "fam"
    for name, data in {**files, "checksums.txt": listing}.items():
        (mirror / name).parent.mkdir(parents=True, exist_ok=True)
        (mirror / name).write_bytes(data)
    monkeypatch.setattr(warm, "_pins", lambda: {"TESTFAM": ("pin/fam/", sha256_hex(listing))})
    pool = tmp_path / "pool"
    code = cli.main(["--pool", str(pool), "prefetch", "--flashinfer", "--family", "TESTFAM",
                     "--arch", "sm_103", "--origin", str(tmp_path / "mirror"), "--json"])
    assert code == 0
    # The family's checksums.txt came first, in a collective of its own; the report is
    # the second one: the sm100f kernel (which runs on sm_103) and the header.
    assert json.loads(capsys.readouterr().out)["downloads"] == 2
    assert set(ArtifactPool(pool).names()) == {
        "pin/fam/checksums.txt", "pin/fam/Gemm_X_sm100f.cubin",
        "pin/fam/include/flashinferMetaInfo.h"}

"""The FlashInfer integration: loader wrapper, install/uninstall, usage records, warm-up."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, merge_manifests, parse_checksums, path_under
from distcache.comm import ThreadGroup
from distcache.errors import (
    ArtifactNameError,
    ConfigError,
    ManifestError,
    OriginError,
    PoolError,
)
from distcache.integrations import flashinfer as fi
from distcache.integrations.flashinfer import _warm as warm
from distcache.integrations.flashinfer._record import (
    Recorder,
    read_record,
    record_file_name,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def flashinfer_imported() -> None:
    """Import the real FlashInfer once with its import-time deprecation warnings (from
    its own dependencies) silenced; the tests then run with warnings as errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.artifacts
        import flashinfer.jit.attention.modules
        import flashinfer.jit.cubin_loader  # noqa: F401


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeOrigin:
    def __init__(self, files: dict[str, bytes], *, fail: bool = False) -> None:
        self.files = files
        self.fail = fail
        self.calls: list[str] = []

    def describe(self) -> str:
        return "fake://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls.append(artifact.name)
        if self.fail or artifact.name not in self.files:
            raise OriginError(f"no {artifact.name}", status=404, name=artifact.name)
        return self.files[artifact.name]


class FakePool:
    """The agreed ArtifactPool surface the loader uses, in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects: dict[str, bytes] = {}
        self.fetches = 0
        self.materialized: list[str] = []

    def get(self, digest: str, *, trust_own: bool = False) -> bytes | None:
        return self.objects.get(digest)

    def put(self, data: bytes, sha256: str | None = None) -> str:
        digest = sha(data)
        assert sha256 in (None, digest)
        self.objects[digest] = data
        return digest

    def fetch(self, artifact: Artifact, origin: Any) -> bytes:
        self.fetches += 1
        data = self.get(artifact.sha256)
        if data is None:
            data = origin.fetch(artifact)
            self.put(data, artifact.sha256)
        return data

    def materialize(self, artifact: Artifact, into_dir: Path) -> Path:
        target = path_under(Path(into_dir), artifact.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.objects[artifact.sha256])
        self.materialized.append(artifact.name)
        return target


class FakeFlashInfer:
    """FlashInfer's get_artifact contract: bytes, b"" on failure, may raise."""

    def __init__(self, answer: bytes = b"flashinfer-own", *, raises: bool = False) -> None:
        self.answer = answer
        self.raises = raises
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, file_name: Any, sha256: Any, session: Any = None) -> bytes:
        self.calls.append((file_name, sha256))
        if self.raises:
            raise RuntimeError("Artifact not found locally (FLASHINFER_NO_DOWNLOAD)")
        return self.answer


CUBIN = b"\x7fELF-cubin-bytes" * 100
CUBIN_NAME = "ce0795149bb2a183db22de04a3fec3aca65fff04/fmha/trtllm-gen/fmhaKernel.cubin"
HEADER = b"// header\n" * 50
HEADER_NAME = "14e0be19166763fb6a00cc6cb0e9bcf9b0231159/gemm/include/flashinferMetaInfo.h"


@pytest.fixture
def pool(tmp_path: Path) -> FakePool:
    return FakePool(tmp_path / "pool")


@pytest.fixture
def cubin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cubins"
    path.mkdir()
    return path


def make_loader(
    pool: FakePool,
    cubin_dir: Path,
    origin: FakeOrigin | None = None,
    original: FakeFlashInfer | None = None,
    **kwargs: Any,
) -> fi.PooledLoader:
    return fi.PooledLoader(
        pool,  # type: ignore[arg-type]
        original or FakeFlashInfer(),
        origin=origin or FakeOrigin({CUBIN_NAME: CUBIN, HEADER_NAME: HEADER}),  # type: ignore[arg-type]
        cubin_dir=lambda: cubin_dir,
        **kwargs,
    )


# --- the loader ---------------------------------------------------------------------


def test_pool_hit_returns_bytes_without_origin_or_flashinfer(
    pool: FakePool, cubin_dir: Path
) -> None:
    pool.put(CUBIN)
    origin, original = FakeOrigin({}), FakeFlashInfer()
    loader = make_loader(pool, cubin_dir, origin, original)
    assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert origin.calls == [] and original.calls == []
    assert loader.stats.hits == 1


def test_miss_is_fetched_through_the_pool_once(pool: FakePool, cubin_dir: Path) -> None:
    origin = FakeOrigin({CUBIN_NAME: CUBIN})
    loader = make_loader(pool, cubin_dir, origin)
    assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert origin.calls == [CUBIN_NAME]
    assert (loader.stats.fetched, loader.stats.hits) == (1, 1)


def test_doubled_slash_from_flashinfer_is_normalised(pool: FakePool, cubin_dir: Path) -> None:
    origin = FakeOrigin({CUBIN_NAME: CUBIN})
    loader = make_loader(pool, cubin_dir, origin)
    doubled = CUBIN_NAME.replace("trtllm-gen/", "trtllm-gen//")
    assert loader(doubled, sha(CUBIN)) == CUBIN
    assert origin.calls == [CUBIN_NAME]


def test_origin_failure_falls_back_to_flashinfer_and_logs_once(
    pool: FakePool, cubin_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    original = FakeFlashInfer(CUBIN)
    loader = make_loader(pool, cubin_dir, FakeOrigin({}, fail=True), original)
    with caplog.at_level(logging.WARNING, logger=fi.__name__):
        assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
        assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert len(original.calls) == 2
    warnings = [r for r in caplog.records if CUBIN_NAME in r.getMessage()]
    assert len(warnings) == 1 and "OriginError" in warnings[0].getMessage()
    assert loader.stats.fallbacks == 2


def test_what_flashinfer_raises_in_the_fallback_passes_through_unchanged(
    pool: FakePool, cubin_dir: Path
) -> None:
    loader = make_loader(pool, cubin_dir, FakeOrigin({}, fail=True), FakeFlashInfer(raises=True))
    with pytest.raises(RuntimeError, match=r"^Artifact not found locally \(FLASHINFER_NO_DOWNLOAD\)$"):
        loader(CUBIN_NAME, sha(CUBIN))
    assert "OriginError" in loader.stats.failures[CUBIN_NAME]


def test_unexpected_pool_error_never_reaches_the_caller(pool: FakePool, cubin_dir: Path) -> None:
    def broken(_: str, **__: bool) -> bytes:
        raise OSError("disk on fire")

    pool.get = broken  # type: ignore[method-assign]
    original = FakeFlashInfer(CUBIN)
    loader = make_loader(pool, cubin_dir, original=original)
    assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert "disk on fire" in loader.stats.failures[CUBIN_NAME]


class UnwritablePool(FakePool):
    """A pool whose ``objects/`` refuses every publication, after the download."""

    def fetch(self, artifact: Artifact, origin: Any) -> bytes:
        self.fetches += 1
        origin.fetch(artifact)
        raise PoolError("cannot publish objects/ab/...: Permission denied", path="objects")

    def put(self, data: bytes, sha256: str | None = None) -> str:
        raise PoolError("cannot publish: Permission denied", path="objects")

    def materialize(self, artifact: Artifact, into_dir: Path) -> Path:
        raise PoolError(f"{artifact.name} is not in the pool", path="objects")


@pytest.mark.parametrize("name, data", [(CUBIN_NAME, CUBIN), (HEADER_NAME, HEADER)])
def test_a_download_the_pool_cannot_publish_is_returned_and_flashinfer_is_not_asked(
    tmp_path: Path, cubin_dir: Path, caplog: pytest.LogCaptureFixture, name: str, data: bytes
) -> None:
    pool = UnwritablePool(tmp_path / "pool")
    origin, original = FakeOrigin({CUBIN_NAME: CUBIN, HEADER_NAME: HEADER}), FakeFlashInfer()
    loader = make_loader(pool, cubin_dir, origin, original)
    with caplog.at_level(logging.WARNING):
        assert loader(name, sha(data)) == data
        assert loader(name, sha(data)) == data
    # A header FlashInfer opens by path is written from the bytes, and found there next.
    downloads = 1 if name == HEADER_NAME else 2
    assert origin.calls == [name] * downloads and original.calls == []
    assert loader.stats.unpublished == downloads and loader.stats.fallbacks == 0
    logged = [r for r in caplog.records if "cannot take downloads" in r.getMessage()]
    assert len(logged) == 1  # once per pool
    if name == HEADER_NAME:
        assert path_under(cubin_dir, name).read_bytes() == HEADER


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "pin/../../x.cubin",
    ],
)
def test_hostile_names_answer_empty_and_touch_nothing(
    pool: FakePool, tmp_path: Path, name: Any
) -> None:
    cubin_dir = tmp_path / "deep" / "cubins"
    cubin_dir.mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    original, origin = FakeFlashInfer(b"secret"), FakeOrigin({})
    loader = make_loader(pool, cubin_dir, origin, original)
    assert loader(name, sha(CUBIN)) == b""
    assert original.calls == [] and origin.calls == []
    assert sorted(tmp_path.rglob("*")) == before
    assert loader.stats.rejected == 1


def test_invalid_digest_and_unpooled_family_go_to_flashinfer(
    pool: FakePool, cubin_dir: Path
) -> None:
    original = FakeFlashInfer(b"own")
    loader = make_loader(
        pool, cubin_dir, original=original, families=fi.Families(pooled=("*/trtllm-gen/*",))
    )
    assert loader(CUBIN_NAME, "NOT-A-SHA") == b"own"
    assert loader(HEADER_NAME, sha(HEADER)) == b"own"
    assert loader.stats.passthrough == 2 and pool.fetches == 0


def test_excluded_glob_wins_over_pooled(pool: FakePool, cubin_dir: Path) -> None:
    families = fi.Families(excluded=("*/checksums.txt",))
    assert families.is_pooled(CUBIN_NAME)
    assert not families.is_pooled("pin/fmha/checksums.txt")


def test_headers_are_materialized_into_the_cubin_dir_and_cubins_are_not(
    pool: FakePool, cubin_dir: Path
) -> None:
    loader = make_loader(pool, cubin_dir)
    assert loader(HEADER_NAME, sha(HEADER)) == HEADER
    assert loader(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert (cubin_dir / HEADER_NAME).read_bytes() == HEADER
    assert not (cubin_dir / CUBIN_NAME).exists()


def test_valid_file_in_cubin_dir_is_not_replaced_and_seeds_the_pool(
    pool: FakePool, cubin_dir: Path
) -> None:
    target = cubin_dir / HEADER_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(HEADER)
    inode = target.stat().st_ino
    origin = FakeOrigin({})
    loader = make_loader(pool, cubin_dir, origin)
    assert loader(HEADER_NAME, sha(HEADER)) == HEADER
    assert target.stat().st_ino == inode
    assert origin.calls == [] and pool.materialized == []
    assert pool.objects[sha(HEADER)] == HEADER and loader.stats.local == 1


def test_stale_file_in_cubin_dir_is_rematerialized(pool: FakePool, cubin_dir: Path) -> None:
    target = cubin_dir / HEADER_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"stale header from another version")
    loader = make_loader(pool, cubin_dir)
    assert loader(HEADER_NAME, sha(HEADER)) == HEADER
    assert target.read_bytes() == HEADER


def test_no_download_mode_asks_flashinfer_instead_of_the_origin(
    pool: FakePool, cubin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLASHINFER_NO_DOWNLOAD", "1")
    origin = FakeOrigin({CUBIN_NAME: CUBIN})
    loader = make_loader(pool, cubin_dir, origin, FakeFlashInfer(raises=True))
    with pytest.raises(RuntimeError, match="FLASHINFER_NO_DOWNLOAD"):
        loader(CUBIN_NAME, sha(CUBIN))
    assert origin.calls == []


def test_loader_records_served_artifacts_once(
    pool: FakePool, cubin_dir: Path, tmp_path: Path
) -> None:
    record = tmp_path / "record"
    loader = make_loader(pool, cubin_dir, recorder=Recorder(record, "r.txt"))
    for _ in range(3):
        loader(CUBIN_NAME, sha(CUBIN))
    loader(HEADER_NAME, sha(HEADER))
    assert read_record(record) == {CUBIN_NAME: sha(CUBIN), HEADER_NAME: sha(HEADER)}
    assert len((record / "r.txt").read_text().splitlines()) == 2


def test_fallback_result_is_recorded_only_when_it_verifies(
    pool: FakePool, cubin_dir: Path, tmp_path: Path
) -> None:
    record = tmp_path / "record"
    loader = make_loader(
        pool,
        cubin_dir,
        FakeOrigin({}, fail=True),
        FakeFlashInfer(b"junk"),
        recorder=Recorder(record, "r.txt"),
    )
    loader(CUBIN_NAME, sha(CUBIN))
    assert read_record(record) == {}


# --- usage records ------------------------------------------------------------------


def test_record_file_is_sha256sum_format(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, "x.txt")
    assert recorder.add("pin/a.cubin", sha(b"a"))
    assert not recorder.add("pin/a.cubin", sha(b"a"))
    recorder.close()
    text = (tmp_path / "x.txt").read_text()
    assert text == f"{sha(b'a')}  pin/a.cubin\n"
    assert parse_checksums(text) == [Artifact("pin/a.cubin", sha(b"a"))]


def test_record_file_name_has_host_pid_and_rank() -> None:
    name = record_file_name({"OMPI_COMM_WORLD_RANK": "3"})
    assert name.endswith(f"-{__import__('os').getpid()}-rank3.txt")
    assert "rank" not in record_file_name({})


def test_concurrent_writers_to_one_file_never_interleave(tmp_path: Path) -> None:
    writers, per_writer = 8, 200
    recorders = [Recorder(tmp_path, "shared.txt") for _ in range(writers)]

    def write(index: int) -> None:
        for i in range(per_writer):
            recorders[index].add(f"pin/w{index}/kernel_{i:04d}.cubin", sha(f"{index}-{i}".encode()))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in recorders:
        r.close()
    entries = read_record(tmp_path)
    assert len(entries) == writers * per_writer
    assert entries["pin/w3/kernel_0007.cubin"] == sha(b"3-7")


def test_concurrent_processes_append_whole_lines(tmp_path: Path) -> None:
    code = (
        "import sys, hashlib\n"
        "from distcache.integrations.flashinfer._record import Recorder\n"
        "r = Recorder(sys.argv[1], 'shared.txt')\n"
        "for i in range(300):\n"
        "    r.add(f'pin/p{sys.argv[2]}/k{i}.cubin', hashlib.sha256(str(i).encode()).hexdigest())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), str(p)], cwd=REPO, start_new_session=True
        )
        for p in range(4)
    ]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    assert len(read_record(tmp_path)) == 1200


def test_truncated_last_line_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(f"{sha(b'a')}  pin/a.cubin\n{sha(b'b')[:20]}")
    assert read_record(tmp_path) == {"pin/a.cubin": sha(b"a")}


def test_conflicting_digests_across_manifests_are_an_error() -> None:
    # Within a usage record the newest digest wins (tests/unit/test_record.py).
    with pytest.raises(ManifestError):
        merge_manifests([("r0", [Artifact("k", sha(b"a"))]), ("r1", [Artifact("k", sha(b"b"))])])


def test_hostile_name_in_record_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(f"{sha(b'a')}  ../../etc/passwd\n")
    with pytest.raises(ArtifactNameError):
        read_record(tmp_path)


def test_missing_record_directory_is_empty(tmp_path: Path) -> None:
    assert read_record(tmp_path / "absent") == {}


# --- collective warm-up with an in-process group ----------------------------------


@pytest.fixture
def fake_collective(monkeypatch: pytest.MonkeyPatch) -> list[list[Artifact]]:
    """Stands in for the collective prefetch: records what each call was given and
    puts the bytes into the pool, as the real collective would."""
    from distcache import _resolve

    calls: list[list[Artifact]] = []

    def prefetch(
        artifacts: list[Artifact],
        *,
        comm: Any,
        pool: Any,
        origin: Any,
        timeout: float | None = None,
        downloads_per_rank: int | None = None,
    ) -> str:
        calls.append(list(artifacts))
        for a in artifacts:
            if pool.get(a.sha256) is None:
                pool.put(origin.fetch(a), a.sha256)
        return f"report:{len(artifacts)}"

    monkeypatch.setattr(_resolve, "collective_prefetch", prefetch)
    monkeypatch.setattr(warm, "collective_prefetch", prefetch)
    return calls


def run_ranks(size: int, fn: Any) -> list[Any]:
    group = ThreadGroup(size, timeout=30)
    results: list[Any] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(group.comm(rank), rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_prefetch_takes_the_union_of_every_ranks_record(
    tmp_path: Path, fake_collective: list[list[Artifact]]
) -> None:
    files = {f"pin/k{i}.cubin": f"kernel {i}".encode() for i in range(4)}
    origin = FakeOrigin(files)
    for rank in range(4):
        # Node-local record directories: rank r only saw kernel r.
        Recorder(tmp_path / f"rec{rank}", "r.txt").add(
            f"pin/k{rank}.cubin", sha(files[f"pin/k{rank}.cubin"])
        )
    pools = [FakePool(tmp_path / f"p{r}") for r in range(4)]

    results = run_ranks(
        4,
        lambda comm, r: fi.prefetch(
            comm=comm, pool=pools[r], record=tmp_path / f"rec{r}", origin=origin
        ),
    )
    assert results == ["report:4"] * 4
    assert all(sorted(a.name for a in call) == sorted(files) for call in fake_collective)


def test_records_of_ranks_that_disagree_on_a_digest_keep_the_newest_on_every_rank(
    tmp_path: Path, fake_collective: list[list[Artifact]]
) -> None:
    import os

    for rank in range(3):
        Recorder(tmp_path / f"rec{rank}", "r.txt").add("pin/k.cubin", sha(b"v%d" % min(rank, 1)))
        # Rank 0's record is the newest: it ran after the upgrade, the others before.
        stamp = 3_000_000 if rank == 0 else 1_000_000 + rank
        os.utime(tmp_path / f"rec{rank}" / "r.txt", (stamp, stamp))
    origin = FakeOrigin({"pin/k.cubin": b"v0"})
    results = run_ranks(
        3,
        lambda comm, r: fi.prefetch(
            comm=comm, pool=FakePool(tmp_path), record=tmp_path / f"rec{r}", origin=origin
        ),
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    assert fake_collective == [[Artifact("pin/k.cubin", sha(b"v0"))]] * 3


def test_prefetch_bad_record_on_one_rank_fails_every_rank(
    tmp_path: Path, fake_collective: list[list[Artifact]]
) -> None:
    (tmp_path / "rec1").mkdir()
    (tmp_path / "rec1" / "r.txt").write_text("garbage line\n")
    results = run_ranks(
        2,
        lambda comm, r: fi.prefetch(
            comm=comm, pool=FakePool(tmp_path), record=tmp_path / f"rec{r}", origin=FakeOrigin({})
        ),
    )
    assert all(isinstance(r, Exception) for r in results), results
    assert isinstance(results[1], ManifestError)


def test_prefetch_merges_manifest_list_and_record(
    tmp_path: Path, fake_collective: list[list[Artifact]]
) -> None:
    Recorder(tmp_path / "rec", "r.txt").add("pin/a.cubin", sha(b"a"))
    origin = FakeOrigin({"pin/a.cubin": b"a", "pin/b.cubin": b"b"})
    report = fi.prefetch(
        comm=__import__("distcache.comm", fromlist=["local"]).local(),
        pool=FakePool(tmp_path),
        manifest=[Artifact("pin/b.cubin", sha(b"b"))],
        record=tmp_path / "rec",
        origin=origin,
    )
    assert report == "report:2"


# --- families -----------------------------------------------------------------------


def test_family_checksums_uses_flashinfers_pinned_hash() -> None:
    from flashinfer.artifacts import ArtifactPath, CheckSumHash

    artifact = warm.family_checksums("trtllm_gen_fmha")
    assert artifact.name == ArtifactPath.TRTLLM_GEN_FMHA + "checksums.txt"
    assert artifact.sha256 == CheckSumHash.TRTLLM_GEN_FMHA
    assert "DSL_FMHA/X86_64/SM_100A" in warm.family_names()


def test_unknown_family_and_unpinned_directory_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown FlashInfer artifact family"):
        warm.family_checksums("NO_SUCH_FAMILY")
    with pytest.raises(ConfigError, match="pins no sha256"):
        warm.family_checksums("deadbeef/custom/")


def test_family_manifest_verifies_and_lists_the_family(pool: FakePool) -> None:
    listing = f"{sha(b'k1')}  k1.cubin\n{sha(b'h')}  include/flashinferMetaInfo.h\n".encode()
    origin = FakeOrigin({"pin/custom/checksums.txt": listing})
    artifacts = fi.family_manifest("pin/custom/", origin, pool=pool, sha256=sha(listing))  # type: ignore[arg-type]
    assert [a.name for a in artifacts] == [
        "pin/custom/checksums.txt",
        "pin/custom/k1.cubin",
        "pin/custom/include/flashinferMetaInfo.h",
    ]


def test_unfetchable_pinned_manifest_is_a_clear_origin_error() -> None:
    with pytest.raises(OriginError, match=r"pinned manifest .*checksums.txt.*fake://origin"):
        fi.family_manifest("TRTLLM_GEN_BMM", FakeOrigin({}))  # type: ignore[arg-type]


# --- install into the real FlashInfer -------------------------------------------


@pytest.fixture
def loader_module() -> Iterator[Any]:
    import flashinfer.jit.cubin_loader as module

    yield module
    fi.uninstall()


def holders(function: object) -> set[str]:
    return {
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith("flashinfer")
        for attr, value in list(vars(module).items())
        if value is function
    }


def test_install_rebinds_every_reference_and_uninstall_restores_them(
    loader_module: Any, pool: FakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashinfer.jit.attention.modules  # noqa: F401 - imports get_artifact by name

    monkeypatch.delenv("DISTCACHE_DISABLE", raising=False)
    monkeypatch.delenv("DISTCACHE_FLASHINFER", raising=False)
    original = loader_module.get_artifact
    before = holders(original)
    assert {
        "flashinfer.jit.cubin_loader.get_artifact",
        "flashinfer.jit.cubin_loader.get_cubin",
        "flashinfer.jit.attention.modules.get_artifact",
    } <= before

    loader = fi.install(pool)  # type: ignore[arg-type]
    assert loader is not None and holders(loader) == before and holders(original) == set()
    assert fi.install(pool) is loader  # type: ignore[arg-type]
    assert loader.original is original  # never wraps itself

    # A module imported after install copies the loader; uninstall restores it too.
    late = types.ModuleType("flashinfer._late_importer")
    late.get_artifact = loader_module.get_artifact  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer._late_importer", late)

    fi.uninstall()
    fi.uninstall()
    assert holders(original) == before | {"flashinfer._late_importer.get_artifact"}
    assert fi.installed() is None


def test_install_with_other_arguments_replaces_the_loader(
    loader_module: Any, tmp_path: Path
) -> None:
    original = loader_module.get_artifact
    first = fi.install(FakePool(tmp_path / "a"))  # type: ignore[arg-type]
    second = fi.install(FakePool(tmp_path / "b"))  # type: ignore[arg-type]
    assert first is not second and second is not None
    assert second.original is original and loader_module.get_artifact is second


@pytest.mark.parametrize("env", [{"DISTCACHE_FLASHINFER": "0"}, {"DISTCACHE_DISABLE": "1"}])
def test_disabled_install_is_a_logged_no_op(
    loader_module: Any,
    pool: FakePool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    original = loader_module.get_artifact
    with caplog.at_level(logging.INFO, logger=fi.__name__):
        assert fi.install(pool) is None  # type: ignore[arg-type]
    assert loader_module.get_artifact is original
    assert "disabled" in caplog.text


def test_installed_wrapper_serves_flashinfers_own_entry_points(
    loader_module: Any, pool: FakePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    pool.put(CUBIN)
    fi.install(pool, origin=FakeOrigin({}))  # type: ignore[arg-type]
    assert loader_module.get_artifact(CUBIN_NAME, sha(CUBIN)) == CUBIN
    assert loader_module.get_cubin(CUBIN_NAME, sha(CUBIN)) == CUBIN


def test_fallback_uses_flashinfers_real_function_on_origin_failure(
    loader_module: Any, pool: FakePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FlashInfer's own function finds the file in its cache directory.
    cubin_dir = tmp_path / "cubins"
    target = cubin_dir / "pin" / "only-flashinfer-has-it.so"
    target.parent.mkdir(parents=True)
    target.write_bytes(CUBIN)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", cubin_dir)
    loader = fi.install(
        pool,
        origin=FakeOrigin({}, fail=True),  # type: ignore[arg-type]
        families=fi.Families(pooled=("*.cubin",)),
    )
    assert loader is not None
    assert loader_module.get_artifact("pin/only-flashinfer-has-it.so", sha(CUBIN)) == CUBIN
    assert loader.stats.passthrough == 1


def test_default_origin_reads_flashinfer_repository_at_call_time(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    for mirror in ("mirror-a", "mirror-b", "mirror-c"):
        (tmp_path / mirror).mkdir()
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", str(tmp_path / "mirror-a"))
    assert str(tmp_path / "mirror-a") in fi.default_origin().describe()
    monkeypatch.delenv("FLASHINFER_CUBINS_REPOSITORY")
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY", str(tmp_path / "mirror-b"))
    assert str(tmp_path / "mirror-b") in fi.default_origin().describe()
    monkeypatch.setenv("DISTCACHE_ORIGIN", str(tmp_path / "mirror-c"))
    assert str(tmp_path / "mirror-c") in fi.default_origin().describe()


def test_importing_the_integration_imports_neither_flashinfer_nor_torch() -> None:
    code = (
        "import sys, distcache.integrations.flashinfer, distcache.integrations.flashinfer._warm\n"
        "bad = [m for m in ('flashinfer', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# --- with the real pool and the loopback origin ------------------------------------


def test_real_pool_serves_flashinfer_from_the_loopback_origin_once(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.store._pool import ArtifactPool
    from distcache.testing import LoopbackOrigin, make_artifacts

    made = make_artifacts(tmp_path / "repo", 3, min_size=1_000, max_size=5_000)
    header = tmp_path / "repo" / "pin" / "include" / "flashinferMetaInfo.h"
    header.parent.mkdir(parents=True)
    header.write_bytes(HEADER)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    with LoopbackOrigin(tmp_path / "repo") as origin:
        monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", origin.url)
        loader = fi.install(ArtifactPool(tmp_path / "pool"))
        assert loader is not None
        for _ in range(2):
            for a in made:
                assert sha(loader_module.get_artifact(a.name, a.sha256)) == a.sha256
        assert loader_module.get_artifact("pin/include/flashinferMetaInfo.h", sha(HEADER)) == HEADER
        assert origin.total_requests == 4
    assert (tmp_path / "cubins" / "pin" / "include" / "flashinferMetaInfo.h").read_bytes() == HEADER
    assert (loader.stats.fetched, loader.stats.hits) == (4, 3)


# --- the `distcache prefetch` subcommand ----------------------------------------------


def cli(*argv: str) -> int:
    import argparse

    from distcache.cli._prefetch import add_parser

    parser = argparse.ArgumentParser(prog="distcache")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def test_cli_prefetch_manifest_fills_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distcache.store._pool import ArtifactPool
    from distcache.testing import make_artifacts

    made = make_artifacts(tmp_path / "mirror", 3, min_size=1_000, max_size=2_000)
    code = cli("prefetch", "--manifest", str(tmp_path / "mirror" / "checksums.txt"),
               "--origin", str(tmp_path / "mirror"), "--pool", str(tmp_path / "pool"))
    assert code == 0
    pool = ArtifactPool(tmp_path / "pool")
    assert all(pool.has(a.sha256) for a in made)
    assert capsys.readouterr().out.strip()


def test_cli_prefetch_flashinfer_record_uses_the_record(tmp_path: Path) -> None:
    from distcache.store._pool import ArtifactPool
    from distcache.testing import make_artifacts

    made = make_artifacts(tmp_path / "mirror", 2, min_size=1_000, max_size=2_000)
    Recorder(tmp_path / "rec", "r.txt").add(made[0].name, made[0].sha256)
    assert cli("prefetch", "--flashinfer", "--record", str(tmp_path / "rec"), "--origin",
               str(tmp_path / "mirror"), "--pool", str(tmp_path / "pool")) == 0
    pool = ArtifactPool(tmp_path / "pool")
    assert pool.has(made[0].sha256) and not pool.has(made[1].sha256)


@pytest.mark.parametrize("argv", [
    ("prefetch", "--manifest", "m.txt", "--record", "r"),
    ("prefetch", "--flashinfer"),
])
def test_cli_prefetch_usage_errors_exit_2(argv: tuple[str, ...]) -> None:
    assert cli(*argv) == 2


def test_cli_prefetch_unreadable_manifest_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("prefetch", "--manifest", str(tmp_path / "absent.txt"), "--origin",
               str(tmp_path), "--pool", str(tmp_path / "pool")) == 1
    assert "cannot read manifest" in capsys.readouterr().err


def test_install_and_uninstall_around_a_running_loader_never_fail_a_call(
    loader_module: Any, pool: FakePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine's loader thread keeps asking for a kernel while another thread installs
    # and uninstalls the wrapper: every call returns the verified bytes, none raises.
    cubin_dir = tmp_path / "cubins"
    target = cubin_dir / CUBIN_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(CUBIN)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", cubin_dir)
    monkeypatch.delenv("DISTCACHE_DISABLE", raising=False)
    monkeypatch.delenv("DISTCACHE_FLASHINFER", raising=False)
    pool.put(CUBIN)
    stop = threading.Event()
    results: list[bytes] = []
    errors: list[BaseException] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                results.append(loader_module.get_artifact(CUBIN_NAME, sha(CUBIN)))
            except BaseException as exc:
                errors.append(exc)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        for _ in range(200):
            fi.install(pool, origin=FakeOrigin({}))  # type: ignore[arg-type]
            fi.uninstall()
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert errors == []
    assert results and set(results) == {CUBIN}
    assert fi.installed() is None


# --- the Integration -----------------------------------------------------------------


def test_flashinfer_is_an_integration_reading_flashinfers_own_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.integrations import Integration

    integration = fi.FlashInfer()
    assert isinstance(integration, Integration) and integration.name == "flashinfer"
    assert integration.available()
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", "http://127.0.0.1:9/cubins/")
    assert integration.default_origin() == "http://127.0.0.1:9/cubins/"
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", "")
    assert integration.default_origin() is None
    assert integration.manifest() == []


def test_materialize_dir_follows_the_loaded_loader_then_the_variable(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", tmp_path / "repointed")
    assert fi.FlashInfer().materialize_dir() == tmp_path / "repointed"
    monkeypatch.delitem(sys.modules, "flashinfer.jit.cubin_loader")
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "from-env"))
    assert fi.FlashInfer().materialize_dir() == tmp_path / "from-env"
    monkeypatch.delenv("FLASHINFER_CUBIN_DIR")
    assert fi.FlashInfer().materialize_dir() is None


def test_flashinfer_manifest_is_what_its_record_lists(tmp_path: Path) -> None:
    Recorder(tmp_path / "rec", "a.txt").add("pin/b.cubin", sha(b"b"))
    Recorder(tmp_path / "rec", "b.txt").add("pin/a.cubin", sha(b"a"))
    assert fi.FlashInfer(tmp_path / "rec").manifest() == [
        Artifact("pin/a.cubin", sha(b"a")), Artifact("pin/b.cubin", sha(b"b"))]


def test_uninstalling_an_integration_leaves_a_newer_wrapper_alone(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTCACHE_DISABLE", raising=False)
    monkeypatch.delenv("DISTCACHE_FLASHINFER", raising=False)
    original = loader_module.get_artifact
    integration = fi.FlashInfer()
    integration.install(FakePool(tmp_path / "a"), None)  # type: ignore[arg-type]
    assert isinstance(loader_module.get_artifact, fi.PooledLoader)
    newer = fi.install(FakePool(tmp_path / "b"))  # type: ignore[arg-type]
    integration.uninstall()
    assert fi.installed() is newer and loader_module.get_artifact is newer
    fi.uninstall()
    assert loader_module.get_artifact is original


# --- one merge rule, one union across ranks -------------------------------------------


def test_merging_keeps_a_repeated_name_once_and_names_both_sources_of_a_conflict() -> None:
    a, b = Artifact("pin/a.cubin", sha(b"a"), size=1), Artifact("pin/b.cubin", sha(b"b"))
    assert merge_manifests([("one", [b, a]), ("two", [Artifact(a.name, a.sha256)])]) == [a, b]
    with pytest.raises(ManifestError, match=r"\(one\).*\(two\)"):
        merge_manifests([("one", [a]), ("two", [Artifact(a.name, sha(b"other"))])])


def test_union_across_ranks_is_the_same_sorted_list_everywhere() -> None:
    from distcache._resolve import union_across_ranks

    lists = [[Artifact(f"pin/k{r}.cubin", sha(b"%d" % r))] for r in range(3)] + [[]]
    lists[2].append(lists[0][0])
    results = run_ranks(4, lambda comm, r: union_across_ranks(comm, lists[r]))
    expected = sorted({a for part in lists for a in part}, key=lambda a: a.name)
    assert results == [expected] * 4
    assert run_ranks(2, lambda comm, r: union_across_ranks(comm, [])) == [[], []]

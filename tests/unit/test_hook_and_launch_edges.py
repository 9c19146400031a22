"""Edges of the start-up hook and the launch wrapper: FlashInfer made importable after
the hook ran, a program that dies of a signal under a launcher that owns the JIT
caches, FlashInfer's own function beside an installed ``flashinfer-cubin``, the
wrapper's implicit materialisation directory, and what the hook imports into every
interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, manifest_text, sha256_hex
from distcache.integrations import _autoinstall
from distcache.integrations import flashinfer as fi
from distcache.integrations.flashinfer import Families
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.process import run_group

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SITE_HOOK = "distcache-autoinstall.pth"
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")

needs_site_hook = pytest.mark.skipif(
    not (Path(sysconfig.get_paths()["purelib"]) / SITE_HOOK).exists(),
    reason="the start-up hook is not in this interpreter's site-packages")


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without distcache's, FlashInfer's or a launcher's variables;
    this tree's code first; FlashInfer's caches under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "FLASHINFER_", "DG_", *_LAUNCHER_PREFIXES))
           and k not in _LAUNCHER_NAMES}
    env.update({"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
                "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws"),
                "XDG_CACHE_HOME": str(tmp_path / "xdg"), **extra})
    return env


def events(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in found if e["event"] == name]


# --- the start-up hook arms whether or not FlashInfer is importable yet ----------------

FAKE_LOADER = """\
FLASHINFER_CUBIN_DIR = None
FLASHINFER_CUBINS_REPOSITORY = "https://example.invalid"
def get_artifact(file_name, sha256, session=None): return b""
def download_file(*a, **k): return False
"""


def test_flashinfer_from_a_later_pth_file_is_wrapped(tmp_path: Path) -> None:
    # A site directory is processed in sorted order: distcache-autoinstall.pth runs
    # before easy-install.pth adds FlashInfer's directory to sys.path.
    fake = tmp_path / "fisrc" / "flashinfer" / "jit"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "cubin_loader.py").write_text(FAKE_LOADER)
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / SITE_HOOK).write_text((REPO / SITE_HOOK).read_text())
    (site_dir / "easy-install.pth").write_text(f"{tmp_path / 'fisrc'}\n")
    log = tmp_path / "events.jsonl"
    code = (f"import site; site.addsitedir({str(site_dir)!r}); "
            "import flashinfer.jit.cubin_loader as cl; "
            "print(cl.__file__, type(cl.get_artifact).__name__)")
    # -S: this interpreter's own site-packages (and its FlashInfer) stay out.
    done = subprocess.run([PY, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env(tmp_path, DISTCACHE_AUTOINSTALL="1",
                                        DISTCACHE_POOL=str(tmp_path / "pool"),
                                        DISTCACHE_LOG_JSON=str(log)))
    assert done.returncode == 0, done.stderr
    where, kind = done.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "fisrc") and kind == "PooledLoader"
    (hook,) = events(log, "engine.hook")
    assert hook["source"] == "startup" and hook["flashinfer"] == "armed"


@pytest.fixture
def hook_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh hook state: its own meta_path, no loader module, an events file."""
    for name in [n for n in os.environ if n.startswith("DISTCACHE_")]:
        monkeypatch.delenv(name)
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(log))
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    monkeypatch.setattr(_autoinstall, "_reported", set())
    monkeypatch.setattr(_autoinstall, "_sources", [])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, _autoinstall.LOADER_MODULE, raising=False)
    return log


def test_startup_arms_even_where_flashinfer_cannot_be_found_yet(
        hook_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _autoinstall.importlib.util.find_spec
    monkeypatch.setattr(_autoinstall.importlib.util, "find_spec", lambda name, package=None: (
        None if name.split(".")[0] == "flashinfer" else real(name, package)))
    assert _autoinstall.arm("startup") is True
    hooks = [f for f in sys.meta_path if isinstance(f, _autoinstall._LoaderHook)]
    assert len(hooks) == 1
    (event,) = events(hook_state, "engine.hook")
    assert event["flashinfer"] == "armed" and event["wrapper"] is False


# --- a program that dies of a signal: the launcher's exit work still runs ----------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_exit_like_a_signal_runs_the_exit_handlers_first(tmp_path: Path, sig: int) -> None:
    marker = tmp_path / "ran"
    code = ("import atexit, launch._child as m\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'a').write('ran\\n'))\n"
            f"m.exit_like(-{int(sig)})\n")
    done = run_group([PY, "-c", code], timeout=120, env=clean_env(tmp_path), cwd=REPO)
    assert done.returncode == -sig, done.stderr
    assert marker.read_text() == "ran\n"  # once


def test_a_program_that_dumps_core_keeps_its_core_file(tmp_path: Path) -> None:
    # The wrapper dies of the program's SIGSEGV too, but without a core of its own,
    # which would be written over the program's at the same name.
    pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    if pattern.startswith("|"):
        pytest.skip(f"core dumps go to a program here ({pattern}), not to files")
    import resource

    def allow_cores() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (1 << 30, 1 << 30))

    work = tmp_path / "cwd"
    work.mkdir()
    env = {**clean_env(tmp_path), "PYTHONPATH": str(REPO)}
    wrapper = subprocess.Popen([PY, "-m", "launch", "--", "sh", "-c", "kill -SEGV $$"],
                               cwd=work, env=env, preexec_fn=allow_cores,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status = os.waitpid(wrapper.pid, 0)
    wrapper.returncode = 0  # reaped here
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert not os.WCOREDUMP(status)


PROGRAMS = {
    "sigterm": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "keyboardinterrupt": "raise KeyboardInterrupt",
}


@needs_site_hook
@pytest.mark.parametrize("how", sorted(PROGRAMS))
def test_the_launcher_publishes_its_jit_caches_when_the_program_dies_of_a_signal(
        tmp_path: Path, how: str) -> None:
    cache = tmp_path / "dg"
    log = tmp_path / "events.jsonl"
    program = (f"import os, pathlib; p = pathlib.Path({str(cache)!r}); p.mkdir(exist_ok=True); "
               f"(p / 'k.so').write_bytes(os.urandom(64)); {PROGRAMS[how]}")
    env = clean_env(tmp_path, DISTCACHE_AUTOINSTALL="1", DISTCACHE_JIT_CACHES="deep_gemm",
                    DG_JIT_CACHE_DIR=str(cache), DISTCACHE_POOL=str(tmp_path / "pool"),
                    DISTCACHE_LOG_JSON=str(log))
    done = run_group([PY, "-m", "launch", "--", PY, "-c", program], timeout=180, env=env,
                     cwd=REPO)
    expected = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    assert done.returncode == -expected, done.stderr[-3000:]
    (published,) = events(log, "engine.jit_publish")
    assert [(f["name"], f["files"]) for f in published["families"]] == [("deep_gemm", 1)]


# --- FlashInfer's own function beside an installed flashinfer-cubin ---------------------

@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """FlashInfer whose FLASHINFER_CUBIN_DIR is an installed flashinfer-cubin holding a
    pooled name and one the pool does not serve; an origin that has them too (a
    request is a download of what was installed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader
    env_module = sys.modules["flashinfer.jit.env"]
    cubins = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "flashinfer_cubin" / "cubins"
    data = b"installed kernel bytes"
    for root in (cubins, tmp_path / "origin"):
        for name in ("pin/x/k.cubin", "pin/x/k.txt"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "FLASHINFER_NO_DOWNLOAD",
                "FLASHINFER_CUBIN_CHECKSUM_DISABLED", "DISTCACHE_DISABLE",
                "DISTCACHE_FLASHINFER", "DISTCACHE_FLASHINFER_FAMILIES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(loader, "FLASHINFER_CUBIN_DIR", cubins)
    monkeypatch.setattr(env_module, "FLASHINFER_CUBIN_DIR", cubins)
    monkeypatch.setattr(env_module, "FLASHINFER_CACHE_DIR", tmp_path / "cache")
    with LoopbackOrigin(tmp_path / "origin") as origin:
        monkeypatch.setattr(loader, "FLASHINFER_CUBINS_REPOSITORY", origin.url)
        before = sorted(cubins.rglob("*"))
        try:
            fi.install(ArtifactPool(tmp_path / "pool"))
            assert tmp_path / "cache" / "cubins" == loader.FLASHINFER_CUBIN_DIR
            yield {"get": loader.get_artifact, "data": data, "sha": sha256_hex(data),
                   "origin": origin}
        finally:
            fi.uninstall()
        assert sorted(cubins.rglob("*")) == before  # never written


def test_a_name_the_pool_does_not_serve_is_read_from_the_installed_dir(
        installed: dict[str, Any]) -> None:
    assert installed["get"]("pin/x/k.txt", installed["sha"]) == installed["data"]
    assert installed["get"]("pin/x/k.cubin", installed["sha"]) == installed["data"]
    assert installed["origin"].total_requests == 0  # nothing downloaded again


def test_offline_flashinfer_finds_the_installed_file(
        installed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHINFER_NO_DOWNLOAD", "1")
    assert installed["get"]("pin/x/k.txt", installed["sha"]) == installed["data"]
    with pytest.raises(RuntimeError, match="Artifact not found locally"):  # FlashInfer's own
        installed["get"]("pin/x/other.txt", installed["sha"])


def test_checksum_disabled_reads_the_installed_file(
        installed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    monkeypatch.setenv("FLASHINFER_NO_DOWNLOAD", "1")
    for name in ("pin/x/k.txt", "pin/x/k.cubin"):
        assert installed["get"](name, "0" * 64) == installed["data"]
    assert installed["origin"].total_requests == 0


def test_a_distcache_failure_falls_back_to_the_installed_file(
        installed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    loader = fi.installed()
    assert loader is not None
    monkeypatch.setattr(loader, "families", Families(pooled=("*",)))

    def broken(artifact: Artifact) -> Any:
        raise ValueError("boom")

    monkeypatch.setattr(loader, "_resolve", broken)
    assert installed["get"]("pin/x/k.txt", installed["sha"]) == installed["data"]
    assert loader.stats.fallbacks == 1 and installed["origin"].total_requests == 0


# --- launch --prefetch: the implicit materialisation directory --------------------------

@pytest.fixture
def prefetch(tmp_path: Path) -> Iterator[dict[str, Any]]:
    artifacts = make_artifacts(tmp_path / "origin", 2, min_size=100, max_size=300)
    manifest = tmp_path / "need.txt"
    manifest.write_text(manifest_text(artifacts))
    with LoopbackOrigin(tmp_path / "origin") as origin:
        yield {"artifacts": artifacts, "manifest": manifest, "origin": origin}


def launch_prefetch(tmp_path: Path, prefetch: dict[str, Any], cubin_dir: Path,
                    *options: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(tmp_path, DISTCACHE_ORIGIN=prefetch["origin"].url,
                    DISTCACHE_POOL=str(tmp_path / "pool"),
                    FLASHINFER_CUBIN_DIR=str(cubin_dir), **extra)
    return run_group([PY, "-m", "launch", "--prefetch", str(prefetch["manifest"]), *options,
                      "--", PY, "-c", "print('PROGRAM ran')"], timeout=180, env=env, cwd=REPO)


def test_an_installed_cubin_dir_is_not_written_by_launch(
        tmp_path: Path, prefetch: dict[str, Any]) -> None:
    cubins = tmp_path / "sp" / "site-packages" / "flashinfer_cubin" / "cubins"
    cubins.mkdir(parents=True)
    done = launch_prefetch(tmp_path, prefetch, cubins)
    assert done.returncode == 0 and "PROGRAM ran" in done.stdout, done.stderr
    assert list(cubins.rglob("*")) == []
    cache = tmp_path / "ws" / ".cache" / "flashinfer" / "cubins"  # where install points
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) \
        == sorted(a.name for a in prefetch["artifacts"])
    assert done.stderr.count("WARNING") == 1


def test_an_unwritable_implicit_dir_is_skipped_with_one_warning(
        tmp_path: Path, prefetch: dict[str, Any]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # FLASHINFER_CUBIN_DIR and FlashInfer's cache both lie under a regular file.
    done = launch_prefetch(tmp_path, prefetch, blocker / "cubins",
                           FLASHINFER_WORKSPACE_BASE=str(blocker / "ws"))
    assert done.returncode == 0 and "PROGRAM ran" in done.stdout, done.stderr
    assert done.stderr.count("WARNING") == 1 and "not linked" in done.stderr


def test_an_implicit_dir_that_refuses_the_files_is_skipped_with_one_warning(
        tmp_path: Path, prefetch: dict[str, Any]) -> None:
    dangling = tmp_path / "cubins"
    dangling.symlink_to(tmp_path / "nowhere" / "cubins")
    done = launch_prefetch(tmp_path, prefetch, dangling)
    assert done.returncode == 0 and "PROGRAM ran" in done.stdout, done.stderr
    assert done.stderr.count("WARNING") == 1 and "not linked" in done.stderr
    assert not (tmp_path / "nowhere").exists()


def test_an_explicit_materialize_dir_stays_strict(
        tmp_path: Path, prefetch: dict[str, Any]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = launch_prefetch(tmp_path, prefetch, tmp_path / "unused",
                           "--materialize", str(blocker / "cubins"))
    assert done.returncode == 1 and "PROGRAM ran" not in done.stdout


# --- what the hook costs every interpreter -----------------------------------------------

MODULES = "import sys; print(' '.join(sorted(sys.modules)))"


def imported_by_the_hook(tmp_path: Path, **extra: str) -> set[str]:
    """The modules ``python -c`` holds with the hook's variables ``extra`` less those it
    holds without them."""
    runs = []
    for env in (clean_env(tmp_path), clean_env(tmp_path, **extra)):
        done = subprocess.run([PY, "-c", MODULES], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path, check=True)
        runs.append(set(done.stdout.split()))
    return runs[1] - runs[0]


HEAVY = {"importlib.abc", "importlib.resources", "multiprocessing", "socket", "hashlib",
         "threading", "distcache.integrations._compile_caches"}


@needs_site_hook
def test_the_armed_hook_imports_a_handful_of_modules(tmp_path: Path) -> None:
    added = imported_by_the_hook(tmp_path, DISTCACHE_AUTOINSTALL="1")
    assert "distcache.integrations._autoinstall" in added  # armed
    assert not added & HEAVY, added & HEAVY
    assert len(added) <= 16, sorted(added)


@needs_site_hook
def test_a_disabled_hook_imports_none_of_its_modules(tmp_path: Path) -> None:
    added = imported_by_the_hook(tmp_path, DISTCACHE_AUTOINSTALL="1", DISTCACHE_DISABLE="1")
    assert {m for m in added if m.startswith("distcache")} == {
        "distcache", "distcache._version", "distcache.integrations",
        "distcache.integrations._startup"}
    assert len(added) <= 10, sorted(added)


@needs_site_hook
def test_the_process_role_is_read_only_for_an_event(tmp_path: Path) -> None:
    added = imported_by_the_hook(tmp_path, DISTCACHE_AUTOINSTALL="1",
                                 DISTCACHE_JIT_CACHES="deep_gemm",
                                 DG_JIT_CACHE_DIR=str(tmp_path / "dg"),
                                 DISTCACHE_POOL=str(tmp_path / "pool"))
    assert "distcache.integrations._compile_caches" in added
    assert "multiprocessing" not in added


@needs_site_hook
def test_a_session_closed_under_the_armed_hook_leaves_the_hooks_wrapper_offline(
        tmp_path: Path) -> None:
    # DISTCACHE_AUTOINSTALL=1 DISTCACHE_OFFLINE=1: the program's own init and close must
    # not leave FlashInfer's loader free to download for the rest of the process.
    arts = make_artifacts(tmp_path / "origin", 2, min_size=500, max_size=900)
    code = ("import os, sys, distcache\n"
            "import flashinfer.jit.cubin_loader as cl\n"
            "distcache.init(manifests=[]).close()\n"
            "print(type(cl.get_artifact).__name__, os.environ.get('FLASHINFER_NO_DOWNLOAD'))\n"
            "try:\n"
            "    cl.get_artifact(sys.argv[1], sys.argv[2])\n"
            "    print('served')\n"
            "except Exception as exc:\n"
            "    print('refused', type(exc).__name__)\n")
    with LoopbackOrigin(tmp_path / "origin") as origin:
        env = clean_env(tmp_path, DISTCACHE_AUTOINSTALL="1", DISTCACHE_OFFLINE="1",
                        DISTCACHE_POOL=str(tmp_path / "pool"),
                        FLASHINFER_CUBINS_REPOSITORY=origin.url,
                        FLASHINFER_CUBIN_DIR=str(tmp_path / "cubins"))
        done = subprocess.run([PY, "-c", code, arts[0].name, arts[0].sha256],
                              capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        requests = origin.total_requests
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert lines[0] == "PooledLoader 1", done.stdout  # the hook's wrapper is back
    assert lines[1].startswith("refused"), done.stdout  # offline: not in the pool
    assert requests == 0

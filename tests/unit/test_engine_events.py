"""The vLLM plugin and the start-up hook each append one ``engine.hook`` event per
process to ``DISTCACHE_LOG_JSON``: pid, role, program and what was installed, also
when FlashInfer is absent or the hooks are disabled."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.integrations import _autoinstall
from distcache.integrations.flashinfer._upstream import LOADER_MODULE

SITE_HOOK = "distcache-autoinstall.pth"


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def log_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    target = tmp_path / "events.jsonl"
    for name in [n for n in os.environ if n.startswith("DISTCACHE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(target))
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    monkeypatch.setattr(_autoinstall, "_reported", set())
    yield target


@pytest.fixture
def no_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as one where FlashInfer is not installed."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name.split(".")[0] == "flashinfer" else real(name, package)

    for name in [n for n in sys.modules if n.split(".")[0] == "flashinfer"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(_autoinstall.importlib.util, "find_spec", find_spec)


def test_plugin_reports_once_per_process_when_flashinfer_is_absent(
        log_json: Path, no_flashinfer: None) -> None:
    from distcache.integrations.vllm import register

    register()
    register()  # vLLM may call a plugin more than once in a process
    (event,) = events(log_json)
    assert event["event"] == "engine.hook" and event["source"] == "vllm"
    assert event["pid"] == os.getpid() and event["ppid"] == os.getppid()
    assert event["role"] == "main"
    assert event["flashinfer"] == "absent" and event["wrapper"] is False
    assert event["jit_families"] == []


def test_plugin_reports_the_installed_wrapper(log_json: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader  # noqa: F401

    from distcache.integrations import flashinfer as fi
    from distcache.integrations.vllm import register

    try:
        register()
        assert fi.installed() is not None
    finally:
        fi.uninstall()
    (event,) = events(log_json)
    assert event["flashinfer"] == "installed" and event["wrapper"] is True


def test_plugin_reports_that_it_is_armed_until_flashinfer_is_imported(
        log_json: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, LOADER_MODULE, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_autoinstall, "_sources", [])
    assert _autoinstall.arm("vllm") is True
    (event,) = events(log_json)
    assert event["flashinfer"] == "armed" and event["wrapper"] is False
    assert any(isinstance(f, _autoinstall._LoaderHook) for f in sys.meta_path)


@pytest.mark.parametrize("switch", ["DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER"])
def test_a_disabled_hook_still_reports(log_json: Path, monkeypatch: pytest.MonkeyPatch,
                                       switch: str) -> None:
    monkeypatch.setenv(switch, "1" if switch == "DISTCACHE_DISABLE" else "0")
    assert _autoinstall.arm("vllm") is False
    (event,) = events(log_json)
    assert event["flashinfer"] == "disabled" and event["wrapper"] is False


def test_a_bad_setting_is_reported_as_failed(log_json: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", "lots")
    assert _autoinstall.arm("vllm") is False
    (event,) = events(log_json)
    assert event["flashinfer"] == "failed"


def test_no_file_no_event_and_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       no_flashinfer: None) -> None:
    monkeypatch.delenv("DISTCACHE_LOG_JSON", raising=False)
    monkeypatch.setattr(_autoinstall, "_reported", set())
    assert _autoinstall.arm("vllm") is False
    assert _autoinstall.report("vllm", "absent") is False
    assert list(tmp_path.iterdir()) == []


def _call_plugin() -> None:
    from distcache.integrations.vllm import register

    register()


def test_each_spawned_process_reports_under_its_own_pid_and_name(log_json: Path) -> None:
    # vLLM names its processes EngineCore and VllmWorker-<rank>; spawn, as vLLM does.
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_call_plugin, name=name)
             for name in ("EngineCore", "VllmWorker-0", "VllmWorker-1")]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    found = {e["pid"]: e for e in events(log_json)}
    assert {p.pid for p in procs} == set(found)
    assert {p.pid: p.name for p in procs} == {pid: e["role"] for pid, e in found.items()}
    assert {e["ppid"] for e in found.values()} == {os.getpid()}


def _site_has_startup_hook() -> bool:
    import sysconfig

    return (Path(sysconfig.get_paths()["purelib"]) / SITE_HOOK).exists()


@pytest.mark.skipif(not _site_has_startup_hook(),
                    reason="the start-up hook is not in this interpreter's site-packages")
@pytest.mark.parametrize("mode", ["-c", "-m"])
def test_startup_hook_reports_at_interpreter_start(tmp_path: Path, mode: str) -> None:
    target = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update(DISTCACHE_AUTOINSTALL="1", DISTCACHE_LOG_JSON=str(target),
               DISTCACHE_POOL=str(tmp_path / "pool"), PYTHONWARNINGS="ignore")
    (tmp_path / "print_pid.py").write_text("import os\nprint(os.getpid())\n")
    cmd = ([sys.executable, "-c", "import os; print(os.getpid())"] if mode == "-c" else
           [sys.executable, "-m", "print_pid"])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, check=True)
    (event,) = events(target)
    assert event["source"] == "startup" and event["pid"] == int(done.stdout)
    assert event["role"] == "main"
    assert event["program"] == ("-c" if mode == "-c" else "print_pid")
    # FlashInfer is installed here but not imported at start-up: armed, not wrapped.
    assert event["flashinfer"] == "armed" and event["wrapper"] is False


@pytest.mark.skipif(not _site_has_startup_hook(),
                    reason="the start-up hook is not in this interpreter's site-packages")
def test_startup_hook_reports_a_bad_setting(tmp_path: Path) -> None:
    target = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update(DISTCACHE_AUTOINSTALL="1", DISTCACHE_LOG_JSON=str(target),
               DISTCACHE_POOL_MAX_BYTES="lots", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", "print('alive')"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "alive\n"
    (event,) = events(target)
    assert event["source"] == "startup" and event["flashinfer"] == "failed"

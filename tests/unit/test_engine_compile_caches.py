"""JIT compile caches through the engine hooks: the first process of a tree fills the
directories of ``DISTCACHE_JIT_CACHES`` from the pool and publishes them at its exit;
the processes it starts inherit it as their owner and do neither; per-rank copies of
one file are one object in the pool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from distcache.integrations import _autoinstall, _compile_caches
from distcache.jit import family, read_trees, union
from distcache.store import ArtifactPool

HASH = "0123456789"
# What a compile leaves in vLLM's cache: one graph per rank, identical bytes.
BUILT = {
    f"{HASH}/rank_0_0/backbone/model": b"graph" * 100,
    f"{HASH}/rank_1_0/backbone/model": b"graph" * 100,
    f"{HASH}/inductor_cache/ab/kernel.py": b"kernel source",
}

ENGINE = """
import json, multiprocessing, os, sys
from pathlib import Path

def build(root):
    for rel, data in json.loads(os.environ["BUILD"]).items():
        path = Path(root, "torch_compile_cache", rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode())

def worker():
    from distcache.integrations.vllm import register
    register()
    build(os.environ["VLLM_CACHE_ROOT"])

if __name__ == "__main__":
    from distcache.integrations.vllm import register
    register()
    if sys.argv[1] == "beside":
        # Another engine of the host starts and ends meanwhile, in a tree of its own.
        import subprocess
        env = {k: v for k, v in os.environ.items() if k != "DISTCACHE_JIT_OWNER"}
        subprocess.run([sys.executable, "-c", "from distcache.integrations.vllm import "
                        "register; register()"], env=env, check=True)
    if sys.argv[1] in ("spawn", "beside"):
        proc = multiprocessing.get_context("spawn").Process(target=worker, name="VllmWorker-0")
        proc.start()
        proc.join(120)
        sys.exit(proc.exitcode)
    build(os.environ["VLLM_CACHE_ROOT"])
"""


def run_engine(tmp: Path, mode: str, built: dict[str, bytes], **extra: str) -> list[dict[str, Any]]:
    """One engine-like process tree; its events."""
    script = tmp / "engine.py"
    script.write_text(ENGINE)
    events = tmp / f"events-{len(list(tmp.glob('events-*')))}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCACHE_", "VLLM_"))}
    env.update(DISTCACHE_POOL=str(tmp / "pool"), DISTCACHE_LOG_JSON=str(events),
               DISTCACHE_JIT_CACHES="vllm", VLLM_CACHE_ROOT=str(tmp / "vllm"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]), PYTHONWARNINGS="ignore",
               BUILD=json.dumps({k: v.decode() for k, v in built.items()}), **extra)
    done = subprocess.run([sys.executable, str(script), mode], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def vllm_family(tmp: Path) -> Any:
    return family("vllm", pool=ArtifactPool(tmp / "pool"),
                  environ={"VLLM_CACHE_ROOT": str(tmp / "vllm")})


def test_exit_publishes_and_a_fresh_directory_is_filled_from_the_pool(tmp_path: Path) -> None:
    first = run_engine(tmp_path, "plain", BUILT)
    (hook,) = [e for e in first if e["event"] == "engine.hook"]
    (jit,) = hook["jit"]
    assert hook["jit_families"] == ["vllm"]
    assert jit["owner"] == hook["pid"] and jit["written"] == 0
    (published,) = [e for e in first if e["event"] == "engine.jit_publish"]
    assert published["pid"] == hook["pid"] and published["families"][0]["files"] == 3
    fam = vllm_family(tmp_path)
    merged = union(read_trees(fam.pool, "vllm", fam.key))
    assert set(merged.entries) == set(BUILT)
    # The two ranks' identical graphs are one object.
    assert len({e.sha256 for e in merged.entries.values()}) == 2

    shutil.rmtree(tmp_path / "vllm")  # a fresh node: the same path, empty
    second = run_engine(tmp_path, "plain", {})
    (hook,) = [e for e in second if e["event"] == "engine.hook"]
    assert hook["jit"][0]["written"] == 3 and hook["jit"][0]["missing"] == 0
    for rel, data in BUILT.items():
        assert (tmp_path / "vllm" / "torch_compile_cache" / rel).read_bytes() == data
    (published,) = [e for e in second if e["event"] == "engine.jit_publish"]
    assert published["families"][0]["files"] == 0  # nothing new


def test_a_child_inherits_its_owner_and_the_owner_publishes_what_it_built(
        tmp_path: Path) -> None:
    events = run_engine(tmp_path, "spawn", BUILT)
    hooks = {e["role"]: e for e in events if e["event"] == "engine.hook"}
    assert set(hooks) == {"main", "VllmWorker-0"}
    main, child = hooks["main"], hooks["VllmWorker-0"]
    assert child["jit"][0]["owner"] == main["pid"]
    assert "written" not in child["jit"][0]  # the owner materialised, not the child
    published = [e for e in events if e["event"] == "engine.jit_publish"]
    assert [e["pid"] for e in published] == [main["pid"]]
    assert published[0]["families"][0]["files"] == 3  # the child's build, at the owner's exit
    # The owner is named in the environment its processes inherit: no file is left.
    assert not [p for p in (tmp_path / "vllm").rglob(".distcache*")]


def test_an_inherited_owner_counts_only_for_a_descendant_and_its_own_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = _compile_caches.OWNER_VARIABLE
    monkeypatch.delenv(name, raising=False)
    _compile_caches.name_owner("abc")
    host, pid, began, digest = os.environ[name].split()
    assert (pid, digest) == (str(os.getpid()), "abc") and began == _compile_caches.started(os.getpid())
    # This process is not its own ancestor; its parent would be.
    assert _compile_caches.inherited_owner("abc") is None
    parent = os.getppid()
    assert parent in _compile_caches.ancestors()
    named = f"{host} {parent} {_compile_caches.started(parent)} abc"
    assert _compile_caches.inherited_owner("abc", {name: named}) == parent
    assert _compile_caches.inherited_owner("other families", {name: named}) is None
    assert _compile_caches.inherited_owner("abc", {name: "another-host" + named[len(host):]}) is None
    # The parent's pid, started at another time: a process that reused it, not the owner.
    assert _compile_caches.inherited_owner("abc", {name: f"{host} {parent} 1 abc"}) is None
    # Pid 1 is everyone's ancestor: a copy naming it (a stale container's) is trusted only
    # where pid 1 is that process.
    assert _compile_caches.inherited_owner("abc", {name: f"{host} 1 0 abc"}) is None


def test_another_engine_on_the_host_leaves_the_first_ones_children_theirs(
        tmp_path: Path) -> None:
    # Another engine of the host, owner of the same directories in a tree of its own,
    # starts and exits while the first runs: the first one's worker still has it as
    # its owner (the owner was named in a file of the cache directory, which the other
    # overwrote, then removed at its exit: the worker became an owner of its own).
    events = run_engine(tmp_path, "beside", BUILT)
    hooks = [e for e in events if e["event"] == "engine.hook"]
    (worker,) = [e for e in hooks if e["role"] == "VllmWorker-0"]
    (main,) = [e for e in hooks if e["pid"] == worker["ppid"]]
    (other,) = [e for e in hooks if e["ppid"] == main["pid"] and e is not worker]
    assert worker["jit"][0]["owner"] == main["pid"] and "written" not in worker["jit"][0]
    assert other["jit"][0]["owner"] == other["pid"]  # its own tree's owner
    publishers = sorted(e["pid"] for e in events if e["event"] == "engine.jit_publish")
    assert publishers == sorted([main["pid"], other["pid"]])

def test_disabled_hooks_leave_the_caches_alone(tmp_path: Path) -> None:
    events = run_engine(tmp_path, "plain", BUILT, DISTCACHE_DISABLE="1")
    (hook,) = [e for e in events if e["event"] == "engine.hook"]
    assert hook["jit"] == [] and hook["flashinfer"] == "disabled"
    assert not [e for e in events if e["event"] == "engine.jit_publish"]
    assert not (tmp_path / "pool").exists()


def test_an_unknown_family_is_reported_not_raised(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(target))
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    monkeypatch.setenv("DISTCACHE_JIT_CACHES", "nosuch")
    monkeypatch.setenv("DISTCACHE_FLASHINFER", "0")
    monkeypatch.setattr(_autoinstall, "_reported", set())
    monkeypatch.setattr(_compile_caches, "_started", {})
    assert _autoinstall.arm("vllm") is False
    (event,) = [json.loads(line) for line in target.read_text().splitlines()]
    assert event["jit_families"] == [] and "nosuch" in event["jit"][0]["error"]


def test_a_forked_copy_of_the_exit_handler_publishes_nothing(tmp_path: Path) -> None:
    built = tmp_path / "vllm" / "torch_compile_cache" / HASH / "rank_0_0" / "model"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"graph")
    fam = vllm_family(tmp_path)
    assert _compile_caches.publish_at_exit([fam], "vllm", "main", os.getpid() + 1) == []
    assert read_trees(fam.pool, "vllm", fam.key) == []
    (row,) = _compile_caches.publish_at_exit([fam], "vllm", "main", os.getpid())
    assert row["files"] == 1 and len(read_trees(fam.pool, "vllm", fam.key)) == 1


def _arm(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int]]:
    """Start the hook for ``vllm`` in this process; the exit handler it registers, and
    a list that grows by one for each publication that scans the directories."""
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(_compile_caches.atexit, "register", lambda *a: registered.append(a))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp / "vllm"))
    _compile_caches._start("startup", "main", ("vllm",), tmp / "pool", None)
    (handler, *args), = registered
    scans: list[int] = []
    for fam in args[0]:
        publish = fam.publish
        fam.publish = lambda *a, _p=publish: scans.append(1) or _p(*a)
    return lambda: handler(*args), scans


def _build(tmp: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = tmp / "vllm" / "torch_compile_cache" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_an_owner_that_changed_nothing_does_not_publish_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _build(tmp_path, BUILT)
    vllm_family(tmp_path).publish()
    exit_handler, scans = _arm(tmp_path, monkeypatch)
    (row,) = exit_handler()
    assert row["files"] == 0 and row["unchanged"] is True and scans == []
    fam = vllm_family(tmp_path)
    assert len(read_trees(fam.pool, "vllm", fam.key)) == 1


def test_an_owner_that_built_a_file_publishes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _build(tmp_path, BUILT)
    vllm_family(tmp_path).publish()
    exit_handler, scans = _arm(tmp_path, monkeypatch)
    _build(tmp_path, {f"{HASH}/rank_2_0/backbone/model": b"another graph"})
    (row,) = exit_handler()
    assert row["files"] == 1 and "unchanged" not in row and scans == [1]


def test_files_the_pool_lacked_when_the_hook_armed_are_published_at_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _build(tmp_path, BUILT)  # built before distcache: no tree lists them yet
    exit_handler, scans = _arm(tmp_path, monkeypatch)
    (row,) = exit_handler()
    assert row["files"] == 3 and scans == [1]
    fam = vllm_family(tmp_path)
    assert set(union(read_trees(fam.pool, "vllm", fam.key)).entries) == set(BUILT)

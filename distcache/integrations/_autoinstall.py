"""Putting the FlashInfer wrapper into a process whose code never calls distcache.

Engines start their own workers (vLLM's engine core and workers, SGLang's schedulers,
TensorRT-LLM's MPI ranks), so ``distcache.init`` cannot reach them. Two hooks run
:func:`arm` in each such process: vLLM's ``vllm.general_plugins`` entry point, and the
start-up hook installed with the package (``distcache-autoinstall.pth``, active only
with ``DISTCACHE_AUTOINSTALL=1``).

:func:`arm` is non-collective, idempotent and never raises. It imports nothing heavy:
when FlashInfer's loader is already imported the wrapper is installed at once;
otherwise a post-import hook installs it the moment FlashInfer's loader module has
been executed, so a process that never uses FlashInfer pays nothing. The hook is put
in place whether or not FlashInfer can be found yet: at interpreter start
``sys.path`` is still being built (a later ``.pth`` file, ``sitecustomize``, the
program itself may add FlashInfer's directory). The pool is
``DISTCACHE_POOL``; the origin is ``DISTCACHE_ORIGIN``, else FlashInfer's own
repository at each miss; ``DISTCACHE_OFFLINE=1`` contacts none.
``DISTCACHE_DISABLE=1`` or ``DISTCACHE_FLASHINFER=0`` turn the wrapper off.

The same hooks fill the JIT compile caches that ``DISTCACHE_JIT_CACHES`` names before
the engine compiles, and publish them when the process exits
(:mod:`distcache.integrations._compile_caches`); ``DISTCACHE_DISABLE=1`` turns that
off too. Each hook reports once per process to ``DISTCACHE_LOG_JSON`` (an
``engine.hook`` event: pid, role, what it installed), also when it installed nothing,
so that an operator can see that every worker an engine started has it.
"""

from __future__ import annotations

import _thread
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, cast

from distcache._log import get_logger

if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

log = get_logger(__name__)

#: FlashInfer's loader module (``_upstream.LOADER_MODULE``; importing that module here
#: would cost the import of the whole integration at interpreter start).
LOADER_MODULE = "flashinfer.jit.cubin_loader"

# What armed the import hook; the hook sits on sys.meta_path, which is per process.
_lock = _thread.allocate_lock()  # threading's Lock, without importing threading
_sources: list[str] = []


#: The variable naming the JIT compile caches (``distcache.config``'s ``jit_caches``).
JIT_VARIABLE = "DISTCACHE_JIT_CACHES"
#: The variable naming the events file (``distcache._events.VARIABLE``).
EVENTS_VARIABLE = "DISTCACHE_LOG_JSON"


def _events_wanted() -> bool:
    """Whether ``DISTCACHE_LOG_JSON`` names a file (unset or blank: no events)."""
    return bool(os.environ.get(EVENTS_VARIABLE, "").strip())


def arm(source: str) -> bool:
    """Install the wrapper now, or as soon as FlashInfer's loader is imported; fill
    the JIT compile caches of ``DISTCACHE_JIT_CACHES`` (published at exit, see
    :mod:`distcache.integrations._compile_caches`); report both once per process and
    source (:func:`report`).

    Args:
        source: what armed it, for logs (``"vllm"``, ``"startup"``).

    Returns:
        ``True`` when the wrapper is installed or will be at FlashInfer's import;
        ``False`` when the hooks are disabled, arming failed (logged), or a hook that
        runs after start-up (the vLLM plugin) finds FlashInfer not importable (the
        import hook still waits for it); the JIT caches do not change it. Never
        raises.
    """
    state = _arm(source)
    jit: list[dict[str, Any]] = []
    if os.environ.get(JIT_VARIABLE, "").strip():  # the JIT caches' module only then
        try:
            from distcache.integrations._compile_caches import start

            # The role names the process in the exit's event: only read when there is one.
            jit = start(source, process_role() if _events_wanted() else "")
        except Exception as exc:  # never into the engine
            jit = [{"error": f"{type(exc).__name__}: {exc}"}]
    report(source, state, jit_families=[f["name"] for f in jit if "name" in f], jit=jit)
    return state in (INSTALLED, ARMED)


#: What a hook did with FlashInfer's loader in a process (the event's ``flashinfer``).
INSTALLED, ARMED, ABSENT, DISABLED, FAILED = "installed", "armed", "absent", "disabled", "failed"
#: The source of the interpreter's start-up hook, which runs while ``sys.path`` is
#: still being built: it never reports FlashInfer ``absent``.
STARTUP = "startup"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _arm(source: str) -> str:
    try:
        from distcache.config import settings

        conf = settings()
        if conf.disable or not conf.flashinfer:
            log.debug("distcache %s hook: disabled (DISTCACHE_DISABLE / DISTCACHE_FLASHINFER)",
                      source)
            return DISABLED
        if LOADER_MODULE in sys.modules:
            return INSTALLED if install_now(source) else FAILED
        # Always armed: the hook matches one module name, and FlashInfer may become
        # importable after this runs (a later .pth file, sitecustomize, the program's
        # own sys.path changes), so its absence now proves nothing.
        with _lock:
            _sources.append(source)
            if not any(isinstance(f, _LoaderHook) for f in sys.meta_path):
                sys.meta_path.insert(0, _LoaderHook())
        if source != STARTUP and not _importable("flashinfer"):
            log.debug("distcache %s hook: FlashInfer is not importable now", source)
            return ABSENT
        return ARMED
    except Exception as exc:
        log.warning("distcache %s hook: not armed: %s: %s", source, type(exc).__name__, exc)
        return FAILED


# (pid, source) pairs already reported: a forked child reports again under its own pid.
_reported: set[tuple[int, str]] = set()


def process_role() -> str:
    """What this process is, as its engine named it: the ``multiprocessing`` name of a
    spawned process (vLLM's ``EngineCore``, ``VllmWorker-0``); ``"spawned"`` for a
    ``multiprocessing`` child at interpreter start, before it learns its name; else
    ``"main"``."""
    import multiprocessing

    name = multiprocessing.current_process().name
    if name != "MainProcess":
        return name
    return "spawned" if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()) else "main"


def _program() -> str:
    """The module run with ``-m`` (``vllm.model_executor.models.registry``), the
    script's file name, or ``-c``; read from the interpreter's own command line at
    start-up, when ``__main__`` has not run yet."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and spec.name != "__main__":
        return str(spec.name)
    argv = list(getattr(sys, "argv", ()) or [""])
    if argv[0] == "-m":
        orig = list(getattr(sys, "orig_argv", ()))
        return orig[orig.index("-m") + 1] if "-m" in orig[:-1] else "-m"
    return argv[0].rsplit("/", 1)[-1] or "python"


def report(source: str, flashinfer: str, **extra: Any) -> bool:
    """Append this process's ``engine.hook`` event to ``DISTCACHE_LOG_JSON``, once per
    process and ``source``: pid (added by the event writer), ``role``, ``ppid``,
    ``program``, ``flashinfer`` (``installed``, ``armed`` until FlashInfer's loader is
    imported, ``absent`` where a hook after start-up found it not importable then,
    ``disabled`` or ``failed``), ``wrapper`` (a wrapper is
    installed now), ``jit_families`` (the compile-cache families materialised here)
    and ``extra``. The role and program are read only when ``DISTCACHE_LOG_JSON``
    names a file. Returns whether a line was written; never raises."""
    try:
        key = (os.getpid(), source)
        with _lock:
            if key in _reported:
                return False
            _reported.add(key)
        if not _events_wanted():  # the role and program are read only for an event
            return False
        from distcache import _events

        fields: dict[str, Any] = {
            "source": source, "role": process_role(), "ppid": os.getppid(),
            "program": _program(), "flashinfer": flashinfer,
            "wrapper": _wrapper_installed(), "jit_families": [],
        }
        for name in ("RANK", "LOCAL_RANK"):
            if os.environ.get(name, "").strip():
                fields[name.lower()] = os.environ[name]
        fields.update(extra)
        return _events.emit("engine.hook", **fields)
    except Exception as exc:  # telemetry never fails the engine
        log.debug("distcache %s hook: no event: %s", source, exc)
        return False


def _wrapper_installed() -> bool:
    """Whether FlashInfer's loader is wrapped now, without importing FlashInfer."""
    if LOADER_MODULE not in sys.modules:
        return False
    from distcache.integrations.flashinfer import installed

    return installed() is not None


def install_now(source: str) -> bool:
    """Install the wrapper from the settings alone (non-collective); keep an installed
    one. Never raises; returns whether a wrapper is installed."""
    try:
        from distcache.config import settings
        from distcache.integrations.flashinfer import install, installed
        from distcache.origins import open_origin
        from distcache.store import ArtifactPool

        if installed() is not None:
            return True
        conf = settings()
        origin = None if conf.offline or not conf.origins else open_origin(list(conf.origins))
        loader = install(ArtifactPool(conf.pool_dir, max_bytes=conf.pool_max_bytes), origin)
        log.info("distcache %s hook: FlashInfer's loader is served from %s", source,
                 conf.pool_dir)
        return loader is not None
    except Exception as exc:
        log.warning("distcache %s hook: FlashInfer wrapper not installed: %s: %s",
                    source, type(exc).__name__, exc)
        return False


class _LoaderHook:
    """Finds FlashInfer's loader module with the other finders and installs the
    wrapper right after the module has run; then removes itself. A plain class, as
    the import system needs no more (``importlib.abc`` would cost every process its
    import at start-up)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != LOADER_MODULE:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = cast("Loader", _InstallAfter(spec.loader))  # duck-typed
        return spec


class _InstallAfter:
    """Delegates to FlashInfer's own loader, then installs the wrapper."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        with _lock:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LoaderHook)]
            sources = ",".join(dict.fromkeys(_sources)) or STARTUP
            _sources.clear()
        install_now(sources)

"""What distcache reads from FlashInfer: its loader module, its ``FLASHINFER_*``
variables, and the origin a pool miss is fetched from.

Every ``FLASHINFER_*`` read of the library is here. The one piece of process state
of the integration besides the installed wrapper also lives here: the origins opened
for :func:`default_origin`, kept so that each miss does not open a new HTTP session.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import site
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from distcache.config import settings
from distcache.errors import ConfigError
from distcache.origins import open_origin

if TYPE_CHECKING:
    from distcache.origins import Origin

LOADER_MODULE = "flashinfer.jit.cubin_loader"
ENV_MODULE = "flashinfer.jit.env"
ARTIFACTS_MODULE = "flashinfer.artifacts"
REPOSITORY_VARIABLE = "FLASHINFER_CUBINS_REPOSITORY"
CUBIN_DIR_VARIABLE = "FLASHINFER_CUBIN_DIR"
NO_DOWNLOAD_VARIABLE = "FLASHINFER_NO_DOWNLOAD"
CHECKSUM_DISABLED_VARIABLE = "FLASHINFER_CUBIN_CHECKSUM_DISABLED"

# The wrapper's default origin per spec: FlashInfer's loader is one module-level
# function per process, so its misses share one origin (one connection pool).
_origins: dict[tuple[str, ...], Origin] = {}
_origins_lock = threading.Lock()


def available() -> bool:
    """True when FlashInfer is importable (without importing it)."""
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


def loader_module() -> ModuleType:
    """FlashInfer's ``cubin_loader`` module, imported on first use.

    Raises:
        ConfigError: FlashInfer is not importable.
    """
    module = sys.modules.get(LOADER_MODULE)
    if module is not None:
        return module
    try:
        import flashinfer.jit.cubin_loader as imported
    except Exception as exc:
        raise ConfigError(
            f"FlashInfer is not importable ({type(exc).__name__}: {exc}); install "
            "flashinfer-python or set DISTCACHE_FLASHINFER=0",
            variable="DISTCACHE_FLASHINFER",
            value=None,
        ) from exc
    return imported


def loader_attr(attr: str) -> Any:
    """An attribute of FlashInfer's loader module (``None`` when it has none).

    Raises:
        ConfigError: FlashInfer is not importable.
    """
    return getattr(loader_module(), attr, None)


def pinned_digest(name: str) -> str | None:
    """The sha256 FlashInfer pins for the file ``name`` (a path under its repository)
    in ``flashinfer.artifacts.CheckSumHash.map_checksums`` (its ``checksums.txt``
    manifests), or ``None`` when it pins none or that table cannot be read."""
    module = sys.modules.get(ARTIFACTS_MODULE)
    if module is None:
        try:
            module = importlib.import_module(ARTIFACTS_MODULE)
        except Exception:
            return None
    table = getattr(getattr(module, "CheckSumHash", None), "map_checksums", None)
    value = table.get(name) if isinstance(table, dict) else None
    return value if isinstance(value, str) else None


def cubin_dir() -> Path | None:
    """The directory FlashInfer's loader reads ``<dir>/<name>`` from, now: its module
    attribute (programs repoint it) when the loader is loaded, else
    ``$FLASHINFER_CUBIN_DIR``, else ``None`` (FlashInfer's default is only known once
    FlashInfer is imported, which costs seconds)."""
    loaded = sys.modules.get(LOADER_MODULE)
    value = getattr(loaded, CUBIN_DIR_VARIABLE, None) if loaded is not None else None
    if value is None:
        value = os.environ.get(CUBIN_DIR_VARIABLE) or None
    return Path(value) if value is not None else None


def repository() -> str | None:
    """``$FLASHINFER_CUBINS_REPOSITORY`` (a blank value counts as unset, as in
    FlashInfer), else ``None``."""
    return os.environ.get(REPOSITORY_VARIABLE) or None


def no_download() -> bool:
    """FlashInfer's ``FLASHINFER_NO_DOWNLOAD``: any non-empty value forbids downloads."""
    return bool(os.environ.get(NO_DOWNLOAD_VARIABLE))


def checksum_disabled() -> bool:
    """FlashInfer's ``FLASHINFER_CUBIN_CHECKSUM_DISABLED``: any non-empty value makes its
    loader return the file in its cubin directory whatever its sha256 (read per call,
    as FlashInfer does)."""
    return bool(os.environ.get(CHECKSUM_DISABLED_VARIABLE))


def forbid_downloads() -> bool:
    """Set ``FLASHINFER_NO_DOWNLOAD=1`` so that FlashInfer's own loader contacts no
    origin either (it reads the variable at every call). Returns whether it was unset
    before (the caller restores it then)."""
    was_unset = not no_download()
    if was_unset:
        os.environ[NO_DOWNLOAD_VARIABLE] = "1"
    return was_unset


def allow_downloads() -> None:
    """Undo :func:`forbid_downloads`."""
    os.environ.pop(NO_DOWNLOAD_VARIABLE, None)


def _install_roots() -> list[Path]:
    """Directories packages are installed into (site-packages, dist-packages)."""
    roots: set[str] = set()
    for key in ("purelib", "platlib"):
        roots.add(sysconfig.get_path(key))
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return [Path(r).resolve() for r in roots if r]


def is_installed_location(path: Path) -> bool:
    """True when ``path`` lies in an installation directory (site-packages, a
    package's own directory), where materialising must never write."""
    resolved = path.resolve()
    if any(part in ("site-packages", "dist-packages") for part in resolved.parts):
        return True
    return any(resolved.is_relative_to(root) for root in _install_roots())


def _writable(path: Path) -> bool:
    """True when ``path`` (or its first existing ancestor) accepts new files."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def flashinfer_cache_dir() -> Path:
    """Where FlashInfer keeps cubins when no package provides them: its
    ``FLASHINFER_CACHE_DIR / "cubins"`` when its ``env`` module is loaded, else the
    same default computed here (``$FLASHINFER_WORKSPACE_BASE``, set blank the working
    directory, else ``~``, then ``.cache/flashinfer/cubins``)."""
    env = sys.modules.get(ENV_MODULE)
    cache = getattr(env, "FLASHINFER_CACHE_DIR", None) if env is not None else None
    if cache is None:
        base = os.environ.get("FLASHINFER_WORKSPACE_BASE")
        base = str(Path.home()) if base is None else base
        cache = Path(base) / ".cache" / "flashinfer"
    return Path(cache) / "cubins"


def writable_cubin_dir(current: Path | None) -> Path | None:
    """The directory materialised files go to: ``current`` when it is writable and
    not an installation directory, else FlashInfer's own cache directory (``None``
    when that is not writable either)."""
    if current is not None and not is_installed_location(current) and _writable(current):
        return current
    fallback = flashinfer_cache_dir()
    return fallback if _writable(fallback) and not is_installed_location(fallback) else None


def default_origin() -> Origin:
    """The origin a pool miss is fetched from, resolved now:
    ``DISTCACHE_ORIGIN``, else ``$FLASHINFER_CUBINS_REPOSITORY``, else FlashInfer's
    ``cubin_loader.FLASHINFER_CUBINS_REPOSITORY`` (its built-in default, or what a
    program assigned to it).

    Raises:
        ConfigError: none of them is set and FlashInfer is not importable.
    """
    specs = settings().origins
    if not specs:
        repo = repository() or loader_attr(REPOSITORY_VARIABLE)
        if not repo:
            raise ConfigError(
                "no origin: set DISTCACHE_ORIGIN or FLASHINFER_CUBINS_REPOSITORY",
                variable="DISTCACHE_ORIGIN",
                value=None,
            )
        specs = (str(repo),)
    with _origins_lock:
        origin = _origins.get(specs)
        if origin is None:
            origin = open_origin(list(specs) if len(specs) > 1 else specs[0])
            _origins[specs] = origin
        return origin

"""FlashInfer's direct ``download_file`` calls, served by the pool.

Not every FlashInfer download goes through ``get_artifact``: FlashInfer 0.7.4's CuTe-DSL
FMHA loader (``flashinfer.attention.cute_dsl.fmha._get_checksums``) and its bulk
downloader (``flashinfer.artifacts``) call ``cubin_loader.download_file`` themselves,
so without this they would bypass the pool, ``FLASHINFER_NO_DOWNLOAD`` and
``DISTCACHE_OFFLINE=1``. While the wrapper is installed, :class:`RoutedDownload`
stands in for that function:

- A file under FlashInfer's repository whose sha256 FlashInfer pins (its
  ``CheckSumHash`` table: the ``checksums.txt`` manifests) is served by the installed
  loader (from the pool, fetched once per pool and verified) and written to the
  destination, as FlashInfer's function would.
- ``get_artifact``'s own download (it passes ``expected_sha256``), a call made while
  such a file is being served, a file without a pinned sha256, and every call while
  ``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` is set go to FlashInfer's function unchanged.
- With ``DISTCACHE_OFFLINE=1`` nothing reaches FlashInfer's function: a call the
  pool cannot serve returns ``False``, FlashInfer's "download failed", after one
  error line (the loader's, for a pinned file it misses; the error FlashInfer's
  loader then raises is logged at debug level only).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distcache._log import get_logger
from distcache._urls import redact_url
from distcache.integrations.flashinfer._files import fd_holds, own_holds, write_replacing
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.integrations.flashinfer._upstream import (
    REPOSITORY_VARIABLE,
    checksum_disabled,
    loader_attr,
    pinned_digest,
)

log = get_logger(__name__)

#: Set while a routed call is served: FlashInfer's functions called from inside
#: (the loader's fallback) then reach FlashInfer's own download.
_serving = threading.local()


def _name_under(repository: Any, source: str) -> str | None:
    """``source`` relative to ``repository`` (FlashInfer joins them with
    ``safe_urljoin``), or ``None`` when it lies elsewhere."""
    if not isinstance(repository, str) or not repository:
        return None
    base = repository if repository.endswith("/") else repository + "/"
    return source[len(base):] if source.startswith(base) and len(source) > len(base) else None


def _write(destination: Path, data: bytes, cubin_dir: Path | None) -> bool:
    """``data`` at ``destination`` through an atomic rename. Below ``cubin_dir``, when
    the destination lies there, no directory is walked through a symlink.

    An identical file is left alone (replacing it would swap the inode under a reader)
    only when :func:`own_holds` finds it so: this user's regular file, reached without a
    symlink. Another user's is replaced, whatever it holds: its owner could rewrite
    it after this check, and FlashInfer reads it by path."""
    destination = Path(os.path.abspath(destination))
    root = Path(os.path.abspath(cubin_dir)) if cubin_dir is not None else None
    if root is None or not destination.is_relative_to(root):
        root = destination.parent  # elsewhere: its directory, as FlashInfer would make it
    if own_holds(root, destination, data):
        return True
    try:
        write_replacing(root, destination, data)
    except OSError as exc:
        if _holds(destination, data):  # a directory of another user's, say: theirs anyway
            log.warning("flashinfer: kept %s, which holds the right bytes but could not be "
                        "replaced by this user's copy: %s", destination, exc)
            return True
        log.error("flashinfer: cannot write %s: %s", destination, exc)
        return False
    return True


def _holds(destination: Path, data: bytes) -> bool:
    """Whether the file at ``destination`` holds exactly ``data`` now: a regular file
    (opened without blocking, so a FIFO there never blocks) compared a piece at a
    time (:func:`fd_holds`): the served bytes are never held twice."""
    try:
        fd = os.open(destination, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and fd_holds(fd, st.st_size, data)
    except OSError:
        return False
    finally:
        os.close(fd)


class RoutedDownload:
    """A drop-in for FlashInfer's ``download_file(source, destination, ...) -> bool``.

    Args:
        loader: the installed wrapper of ``get_artifact``.
        original: FlashInfer's ``download_file``.
        offline: ``DISTCACHE_OFFLINE=1``: never call ``original``.
    """

    def __init__(self, loader: PooledLoader, original: Callable[..., Any], *, offline: bool) -> None:
        self.loader = loader
        self.original = original
        self.offline = offline
        self.routed = 0  #: calls served by the loader
        self.refused = 0  #: offline calls that were not served
        self.__name__ = "download_file"
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, source: Any, destination: Any, *args: Any, **kwargs: Any) -> Any:
        if self.loader.retired:  # uninstalled, but called through another's wrapper
            return self.original(source, destination, *args, **kwargs)
        name = None
        sha256 = None
        if (kwargs.get("expected_sha256") is None and not getattr(_serving, "active", False)
                and not checksum_disabled()):
            name = _name_under(loader_attr(REPOSITORY_VARIABLE), str(source))
            sha256 = pinned_digest(name) if name is not None else None
        if name is None or sha256 is None:
            return self._unrouted(source, destination, args, kwargs)
        self.routed += 1
        _serving.active = True
        try:
            data = self.loader(name, sha256)
        except Exception as exc:  # FlashInfer's own error, from the loader's fallback
            # An offline miss was already logged as an error by the loader, with how
            # to fetch the file: FlashInfer's "not found locally" adds nothing to it.
            level = logging.DEBUG if self.loader.logged_miss() else logging.ERROR
            log.log(level, "flashinfer: %s (sha256 %s) could not be served: %s",
                    name, sha256, exc)
            data = b""
        finally:
            _serving.active = False
        return bool(data) and _write(Path(os.fspath(destination)), data,
                                     self.loader.cubin_dir())

    def _unrouted(self, source: Any, destination: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
        if not self.offline:
            return self.original(source, destination, *args, **kwargs)
        self.refused += 1
        # FlashInfer's repository may be a mirror with a password or a signed query.
        log.error("flashinfer: DISTCACHE_OFFLINE=1: not downloading %s (FlashInfer's "
                  "download_file, for %s); place the file there or unset DISTCACHE_OFFLINE",
                  redact_url(str(source)), destination)
        return False

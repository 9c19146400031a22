"""Read the members of an artifact set: a ``flashinfer-cubin`` wheel (a zip), a
tarball, or a directory.

Each source yields its regular files one at a time, as ``(path, size, bytes or
None)``: the bytes only of the members the caller asks for, so a 2 GB wheel or
tarball is streamed member by member and never held whole in memory. Every member is
checked before it is yielded, and any of these refuses the whole source with a
:class:`~distcache.errors.ConfigError` naming the source and the member: an absolute
path or a ``..`` segment (or any name :func:`~distcache.artifact.validate_name`
rejects), a symbolic or hard link, a device, FIFO or socket, the same path twice, and
an archive that cannot be read (a corrupt or truncated zip, a bad CRC, a broken
compressed stream).
"""

from __future__ import annotations

import os
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from distcache.artifact import validate_name
from distcache.errors import ArtifactNameError, ConfigError

#: ``(path inside the source, size, the bytes when wanted else None)``.
Member = tuple[str, int, bytes | None]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
_ZIP_SUFFIXES = (".whl", ".zip")


def refuse(source: Path, what: str) -> ConfigError:
    """The error for a source that cannot be imported; nothing was imported."""
    return ConfigError(f"cannot import {source}: {what}; nothing was imported",
                       variable="SRC", value=str(source))


def kind_of(source: Path) -> str:
    """``"dir"``, ``"zip"`` or ``"tar"``, from what ``source`` is and its suffix.

    Raises:
        ConfigError: ``source`` does not exist or is none of them.
    """
    if source.is_dir():
        return "dir"
    if not source.is_file():
        raise refuse(source, "no such file or directory")
    name = source.name.lower()
    if name.endswith(_ZIP_SUFFIXES):
        return "zip"
    if name.endswith(_TAR_SUFFIXES):
        return "tar"
    if zipfile.is_zipfile(source):
        return "zip"
    try:
        if tarfile.is_tarfile(source):
            return "tar"
    except OSError:
        pass
    raise refuse(source, "not a wheel (.whl), a tarball (.tar, .tar.gz, .tgz) or a "
                         "directory")


def _is_top(raw: str) -> bool:
    # "tar -C DIR -cf set.tar ." writes the top directory itself as "." or "./".
    return raw.strip("/") in ("", ".")


def _checked_path(source: Path, raw: str) -> str:
    path = raw
    while path.startswith("./"):
        path = path[2:]
    try:
        if path.startswith("/") or ".." in path.split("/"):
            raise ArtifactNameError(f"member {raw!r}", name=raw,
                                    reason="an absolute path or a '..' segment")
        return validate_name(path)
    except ArtifactNameError as exc:
        raise refuse(source, f"unsafe member {raw!r} ({getattr(exc, 'reason', exc)})") from exc


def members(source: Path, kind: str, want: Callable[[str], bool]) -> Iterator[Member]:
    """Every regular file of ``source`` (of ``kind``, see :func:`kind_of`), with its
    bytes when ``want(path)``.

    Raises:
        ConfigError: an unsafe or unsupported member, or an unreadable archive.
    """
    walk = {"dir": _dir_members, "zip": _zip_members, "tar": _tar_members}[kind]
    seen: set[str] = set()
    for path, size, data in walk(source, want):
        if path in seen:
            raise refuse(source, f"member {path!r} appears twice")
        seen.add(path)
        yield path, size, data


def total_bytes(source: Path, kind: str) -> int | None:
    """The bytes of every file in ``source``, where that is cheap to know (a zip's
    directory, a directory tree); ``None`` for a tarball, which is read once."""
    try:
        if kind == "zip":
            with zipfile.ZipFile(source) as archive:
                return sum(info.file_size for info in archive.infolist())
        if kind == "dir":
            return sum(os.lstat(os.path.join(d, f)).st_size
                       for d, _dirs, files in os.walk(source) for f in files)
    except (OSError, zipfile.BadZipFile):
        pass  # the first pass reports what is wrong with the source
    return None


def _zip_members(source: Path, want: Callable[[str], bool]) -> Iterator[Member]:
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise refuse(source, f"not a readable wheel or zip archive ({exc})") from exc
    with archive:
        for info in archive.infolist():
            if info.is_dir() and _is_top(info.filename):
                continue
            path = _checked_path(source, info.filename.rstrip("/") if info.is_dir()
                                 else info.filename)
            mode = info.external_attr >> 16
            if info.is_dir():
                continue
            if mode and not (stat.S_ISREG(mode) or stat.S_IFMT(mode) == 0):
                raise refuse(source, f"member {path!r} is not a regular file "
                                     f"(a link or special file)")
            data = None
            if want(path):
                try:
                    data = archive.read(info)
                except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                    raise refuse(source, f"member {path!r} is corrupt ({exc})") from exc
            yield path, info.file_size, data


def _tar_members(source: Path, want: Callable[[str], bool]) -> Iterator[Member]:
    try:
        # Stream mode ("r|*"): members are read in order, once, with bounded memory.
        with tarfile.open(source, mode="r|*") as archive:
            for info in archive:
                if info.isdir() and _is_top(info.name):
                    continue
                path = _checked_path(source, info.name.rstrip("/") if info.isdir()
                                     else info.name)
                if info.isdir():
                    continue
                if not info.isreg():
                    kind = ("a symbolic link" if info.issym() else "a hard link"
                            if info.islnk() else "a device, FIFO or other special file")
                    raise refuse(source, f"member {path!r} is {kind}")
                data = None
                if want(path):
                    reader = archive.extractfile(info)
                    data = reader.read() if reader is not None else b""
                    if len(data) != info.size:
                        raise refuse(source, f"member {path!r} is truncated")
                yield path, info.size, data
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise refuse(source, f"not a readable tarball ({exc})") from exc
    except OSError as exc:  # gzip.BadGzipFile, lzma and bz2 errors
        raise refuse(source, f"not a readable tarball ({exc})") from exc


def _dir_members(source: Path, want: Callable[[str], bool]) -> Iterator[Member]:
    for dirpath, dirnames, filenames in os.walk(source, onerror=_raise):
        dirnames.sort()
        for entry in sorted([*filenames, *(d for d in dirnames
                                            if os.path.islink(os.path.join(dirpath, d)))]):
            full = os.path.join(dirpath, entry)
            path = _checked_path(source, Path(full).relative_to(source).as_posix())
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise refuse(source, f"{path!r} is {kind}")
            data = None
            if want(path):
                with open(full, "rb") as f:
                    data = f.read()
            yield path, st.st_size, data


def _raise(exc: OSError) -> None:
    raise exc

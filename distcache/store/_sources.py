"""Read the members of an artifact set: a ``flashinfer-cubin`` wheel (a zip), a
tarball, or a directory.

Each source yields its regular files one at a time, as :class:`Member`: the sha256
when the caller asks for it (hashed in chunks), and the bytes only of the members the
caller wants, so a 2 GB wheel or tarball is streamed member by member and never held
whole in memory. Every member is checked before it is read, and any of these refuses
the whole source with a :class:`~distcache.errors.ConfigError` naming the source and
the member: an absolute path or a ``..`` segment (or any name
:func:`~distcache.artifact.validate_name` rejects), a symbolic or hard link, a
device, FIFO or socket, the same path twice, a member larger than an artifact may be
(``DISTCACHE_MAX_ARTIFACT_BYTES``), members kept whole that together hold more than
the caller allows (import's ``checksums.txt`` files), an encrypted zip member, and an
archive that
cannot be read (a corrupt or truncated zip, one of a version or method zipfile
lacks, a bad CRC, a broken compressed stream, a tarball cut short or with a damaged
header). A tarball is read to its end, so the gzip, bzip2 or xz checksums are
verified, and it must end with the end-of-archive marker.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import lzma
import os
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, NamedTuple, Protocol

from distcache.artifact import validate_name
from distcache.errors import ArtifactNameError, ConfigError
from distcache.store._fs import READ_FLAGS


class Member(NamedTuple):
    """One regular file of a source."""

    path: str  #: the path inside the source
    size: int
    sha256: str | None  #: when the caller asked for hashes
    data: bytes | None  #: when the caller wants this member's bytes


TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
_ZIP_SUFFIXES = (".whl", ".zip")
_CHUNK = 1 << 20
_ZIP_ENCRYPTED = 0x1


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...



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
    if not source.exists():
        raise refuse(source, "no such file or directory")
    if not source.is_file():
        # Import reads a source twice (verify, then publish); a pipe reads once.
        raise refuse(source, "not a regular file or directory (a pipe or device cannot "
                             "be read twice; save it to a file first)")
    name = source.name.lower()
    if name.endswith(_ZIP_SUFFIXES):
        return "zip"
    if name.endswith(TAR_SUFFIXES):
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


@dataclass(slots=True)
class _Reader:
    """How the members of one source are read: which to hash, which to keep, the
    largest one allowed, and the most bytes the kept ones may hold together."""

    source: Path
    want: Callable[[str], bool]
    digest: bool
    max_bytes: int | None
    max_kept: int | None = None
    kept: int = 0  #: bytes of the members kept so far

    def member(self, path: str, size: int,
               open_: Callable[[], AbstractContextManager[_Readable]]) -> Member:
        if self.max_bytes is not None and size > self.max_bytes:
            raise refuse(self.source, f"member {path!r} is {size} bytes, more than the "
                                      f"{self.max_bytes} an artifact may be "
                                      "(DISTCACHE_MAX_ARTIFACT_BYTES)")
        keep = self.want(path)
        if keep and self.max_kept is not None:
            self.kept += size
            if self.kept > self.max_kept:
                raise refuse(self.source, f"member {path!r} ({size} bytes) brings the "
                                          "files read whole into memory (its checksums.txt "
                                          f"files) past the {self.max_kept} bytes they may "
                                          "hold together (MAX_MANIFEST_BYTES)")
        if not (keep or self.digest):
            return Member(path, size, None, None)
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        got = 0
        with open_() as stream:
            while chunk := stream.read(min(_CHUNK, size - got + 1)):
                got += len(chunk)
                if got > size:
                    break
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
        if got != size:
            raise refuse(self.source, f"member {path!r} holds {'more' if got > size else 'fewer'}"
                                      f" bytes than the {size} it should (truncated or "
                                      "changed while being read)")
        return Member(path, size, digest.hexdigest() if self.digest else None,
                      b"".join(chunks) if keep else None)


def members(source: Path, kind: str, want: Callable[[str], bool], *, digest: bool = False,
            max_bytes: int | None = None, max_kept: int | None = None) -> Iterator[Member]:
    """Every regular file of ``source`` (of ``kind``, see :func:`kind_of`): with its
    sha256 when ``digest``, with its bytes when ``want(path)``. A member larger than
    ``max_bytes`` is refused before it is read, and so is a wanted one that brings the
    wanted members' bytes together past ``max_kept``.

    Raises:
        ConfigError: an unsafe, oversized or unsupported member, or an unreadable
            archive.
    """
    walk = {"dir": _dir_members, "zip": _zip_members, "tar": _tar_members}[kind]
    seen: set[str] = set()
    for member in walk(_Reader(source, want, digest, max_bytes, max_kept)):
        if member.path in seen:
            raise refuse(source, f"member {member.path!r} appears twice")
        seen.add(member.path)
        yield member


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
    except (OSError, zipfile.BadZipFile, NotImplementedError, ValueError):
        pass  # the first pass reports what is wrong with the source
    return None


def _zip_members(reader: _Reader) -> Iterator[Member]:
    source = reader.source
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, OSError,
            ValueError) as exc:
        # NotImplementedError: a zip version or feature zipfile lacks; OSError and
        # ValueError: a directory or offset that points outside the file.
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
            if info.flag_bits & _ZIP_ENCRYPTED:
                raise refuse(source, f"member {path!r} is encrypted")
            try:
                member = reader.member(path, info.file_size, partial(archive.open, info))
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError,
                    RuntimeError, OSError) as exc:
                # OSError: an offset that points outside the file (a negative seek).
                raise refuse(source, f"member {path!r} is corrupt ({exc})") from exc
            yield member


class _StrictTarInfo(tarfile.TarInfo):
    """A header that tarfile would take as a quiet end of the archive (a damaged or
    missing header after the first member) is an error; only a zero block ends it."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> _StrictTarInfo:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            if tarfile_.offset == 0 or type(exc).__name__ == "EOFHeaderError":  # private
                raise
            raise tarfile.ReadError(f"bad or missing header at byte {tarfile_.offset} "
                                    f"({exc}): the tarball is cut short or damaged") from None


def _decompressed(raw: IO[bytes]) -> IO[bytes] | gzip.GzipFile | bz2.BZ2File | lzma.LZMAFile:
    # gzip, bz2 and lzma verify their checksums once read to the end, which tarfile's
    # own stream reader does not do for gzip.
    magic = raw.read(6)
    raw.seek(0)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)
    return raw


def _tar_members(reader: _Reader) -> Iterator[Member]:
    source = reader.source
    try:
        with open(source, "rb") as raw, _decompressed(raw) as stream:
            # Stream mode ("r|"): members are read in order, once, with bounded memory.
            with tarfile.open(fileobj=stream, mode="r|", tarinfo=_StrictTarInfo) as archive:
                yield from _tar_walk(reader, archive)
            # Past the end-of-archive marker: read the rest so a compressed stream's
            # checksum is checked.
            while stream.read(_CHUNK):
                pass
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise refuse(source, f"not a readable tarball ({exc})") from exc
    except OSError as exc:  # gzip.BadGzipFile, bz2 errors, an xz file's bad header
        raise refuse(source, f"not a readable tarball ({exc})") from exc


def _tar_walk(reader: _Reader, archive: tarfile.TarFile) -> Iterator[Member]:
    source = reader.source
    for info in archive:
        if info.isdir() and _is_top(info.name):
            continue
        path = _checked_path(source, info.name.rstrip("/") if info.isdir() else info.name)
        if info.isdir():
            continue
        if not info.isreg():
            kind = ("a symbolic link" if info.issym() else "a hard link"
                    if info.islnk() else "a device, FIFO or other special file")
            raise refuse(source, f"member {path!r} is {kind}")
        yield reader.member(path, info.size, partial(_extract, archive, info))


def _extract(archive: tarfile.TarFile, info: tarfile.TarInfo) -> IO[bytes]:
    stream = archive.extractfile(info)
    assert stream is not None  # a regular file
    return stream


def _dir_members(reader: _Reader) -> Iterator[Member]:
    source = reader.source
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
            yield reader.member(path, st.st_size, partial(_open_file, source, path, full, st))


def _open_file(source: Path, path: str, full: str, st: os.stat_result) -> IO[bytes]:
    """``full`` opened to read, if it is still the regular file ``st`` describes: one
    swapped since for a symlink is not followed, a FIFO not blocked on."""
    try:
        fd = os.open(full, READ_FLAGS)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise refuse(source, f"{path!r} was replaced by a symbolic link while being "
                             "read") from exc
    now = os.fstat(fd)
    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise refuse(source, f"{path!r} was replaced while being read")
    return open(fd, "rb")


def _raise(exc: OSError) -> None:
    raise exc

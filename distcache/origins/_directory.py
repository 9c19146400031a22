"""A mirror directory as an origin: artifacts at ``<mirror>/<name>``, verified as read."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from distcache.artifact import Artifact, path_under
from distcache.config import setting
from distcache.errors import ArtifactNotFound, IntegrityError, OriginError, OriginUnreachable
from distcache.origins._base import BaseOrigin

_CHUNK = 1 << 20
_T = TypeVar("_T")


class DirOrigin(BaseOrigin):
    """Artifacts at ``path/<name>`` in a local or shared mirror directory.

    Symlinks inside the mirror are followed only while they stay inside it. A file
    for an artifact of unknown size is refused past ``DISTCACHE_MAX_ARTIFACT_BYTES``.

    Raises:
        ArtifactNotFound: (from ``fetch``) the mirror has no such file.
        OriginUnreachable: (from ``fetch``) the mirror directory itself is gone
            (moved, deleted, unmounted, or a link to a removed release), having been
            one when the origin was made or when it served a file since.
        OriginError: (from ``fetch``) a symlink leaving the mirror, an unreadable
            file, or a file of an artifact of unknown size over the byte cap.
        IntegrityError: (from ``fetch``) the file's bytes do not match the artifact.
        ArtifactNameError: (from ``fetch``) the name is unsafe.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # Absolute now: a later chdir of the process does not move the mirror.
        self.path = Path(path).absolute()
        self._resolved: Path | None = None
        # Whether the mirror was ever seen as a directory: only one that was is "gone"
        # when it no longer is (one not made yet lacks each artifact, as an empty one).
        self._seen = self.path.is_dir()

    def describe(self) -> str:
        return f"dir:{self.path}"

    def __repr__(self) -> str:
        return f"DirOrigin({str(self.path)!r})"

    def _root(self, again: bool = False) -> Path:
        # Resolved once: a family of thousands of files pays for it once, not per file;
        # ``again`` when a file seems outside it: the mirror's path may be a symlink
        # retargeted since (a release flip of current -> v2), which the file followed.
        if self._resolved is None or again:
            self._resolved = self.path.resolve()
        return self._resolved

    def _not_regular(self, artifact: Artifact, candidate: Path, mode: int) -> OriginError:
        what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "another kind of file")
        return OriginError(
            f"{candidate} in mirror {self.path} is not a regular file ({what}); a mirror "
            "holds the artifacts' files: remove it or replace it with the file",
            url=str(candidate), status=None, name=artifact.name)

    def _missing(self, artifact: Artifact, candidate: Path) -> OriginError:
        """Why ``candidate`` could not be found: the mirror itself is gone (deleted,
        moved, a link to a removed release: every artifact would fail alike, so the
        origin is unreachable, not each artifact missing), or the mirror lacks it (a
        link in it to nothing is named as one; so is a mirror never made yet)."""
        try:
            mode: int | None = os.stat(self.path).st_mode
        except OSError:
            mode = None
        what = "no such directory" if mode is None else "not a directory"
        if self._seen and (mode is None or not stat.S_ISDIR(mode)):
            return OriginUnreachable(
                f"mirror {self.path} is gone ({what}): it was moved, deleted or unmounted "
                "since this origin was opened; restore it, or point DISTCACHE_ORIGIN (or "
                "--origin) at where the mirror is now",
                url=str(self.path), name=artifact.name, cause=what)
        try:
            link = f" (a symbolic link to {os.readlink(candidate)}, which does not exist)"
        except OSError:
            link = "" if mode is not None and stat.S_ISDIR(mode) else f" (the mirror: {what})"
        return ArtifactNotFound(
            f"{artifact.name} is not in mirror {self.path} (looked for {candidate}{link}); "
            "add it to the mirror or put another origin after this one",
            url=str(candidate), name=artifact.name)

    def _open(self, artifact: Artifact, candidate: Path) -> int:
        """Open ``candidate`` (following symlinks) and check that the file reached is
        inside the mirror. The kernel names the file an fd reached in one call
        (``/proc/self/fd``), so the per-component walk of ``resolve`` is paid only
        where ``/proc`` is missing."""
        try:
            # Refused from its stat, before it is opened: opening a device node can act
            # on the device (a tape rewinds), opening a FIFO is seen by its writer.
            mode = os.stat(candidate).st_mode
            if not stat.S_ISREG(mode):
                raise self._not_regular(artifact, candidate, mode)
            # O_NONBLOCK: a FIFO put in place of the file since the stat must not hang
            # the open (the fstat after it refuses it).
            fd = os.open(candidate, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(artifact, candidate) from None
        except OSError as exc:
            raise OriginError(f"cannot read {candidate} in mirror {self.path}: {exc}",
                              url=str(candidate), status=None, name=artifact.name) from exc
        try:
            try:
                real = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                real = candidate.resolve(strict=True)
            root = self._root()
            if not real.is_relative_to(root) and not real.is_relative_to(
                    root := self._root(again=True)):
                raise OriginError(
                    f"refused {candidate}: it is a symlink to {real}, outside mirror {root}; "
                    "mirrors must hold their files (or links within themselves)",
                    url=str(candidate), status=None, name=artifact.name,
                )
        except BaseException:
            os.close(fd)
            raise
        self._seen = True
        return fd

    def _read(self, artifact: Artifact, candidate: Path, read: Callable[[int], _T],
              arg: int) -> _T:
        """``read(arg)``, an access to the mirror's file; its OSError as an OriginError."""
        try:
            return read(arg)
        except IsADirectoryError as exc:
            raise OriginError(f"{candidate} in mirror {self.path} is a directory, not a file",
                              url=str(candidate), status=None, name=artifact.name) from exc
        except OSError as exc:
            raise OriginError(f"cannot read {candidate} in mirror {self.path}: {exc}",
                              url=str(candidate), status=None, name=artifact.name) from exc

    def _over_cap(self, artifact: Artifact, candidate: Path, cap: int) -> OriginError:
        return OriginError(
            f"{candidate} in mirror {self.path} exceeds the cap of {cap} bytes for an "
            "artifact of unknown size; give the artifact's size in the manifest, or "
            "raise DISTCACHE_MAX_ARTIFACT_BYTES if it really is this large",
            url=str(candidate), status=None, name=artifact.name)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        candidate = path_under(self.path, artifact.name)
        fd = self._open(artifact, candidate)
        digest = hashlib.sha256()
        count = 0
        limit = artifact.size
        try:  # a file that is a directory by now fails here, the mirror's failure too
            opened = self._read(artifact, candidate, lambda f: open(f, "rb"), fd)  # noqa: SIM115
        except OriginError:
            os.close(fd)
            raise
        with opened as src:
            # Only the mirror's side is the mirror's failure: an error writing ``out``
            # (the pool's disk full) passes through as it is, not as the origin's.
            info = self._read(artifact, candidate, os.fstat, fd)
            if not stat.S_ISREG(info.st_mode):  # replaced since the stat in _open
                raise self._not_regular(artifact, candidate, info.st_mode)
            # An artifact of unknown size is capped like an HTTP body; a file
            # already over the cap is refused before a byte is read.
            bound = setting("max_artifact_bytes") if limit is None else limit
            if limit is None and info.st_size > bound:
                raise self._over_cap(artifact, candidate, bound)
            # Read at most one byte past the bound: a huge (or sparse) file in the
            # mirror is refused without reading it all, and nothing past the
            # declared size (or the cap) reaches ``out``.
            while chunk := self._read(artifact, candidate, src.read,
                                      min(_CHUNK, bound + 1 - count)):
                count += len(chunk)
                digest.update(chunk)
                if count > bound:
                    if limit is None:  # the file grew while it was read
                        raise self._over_cap(artifact, candidate, bound)
                    break
                out.write(chunk)
        actual = digest.hexdigest()
        if actual != artifact.sha256 or (limit is not None and count != limit):
            size_note = ""
            if limit is not None and count != limit:
                found = f"over {limit}" if count > limit else str(count)
                size_note = f" (size {found}, expected {limit})"
            raise IntegrityError(
                f"sha256 mismatch for {artifact.name} in mirror {self.path}{size_note}: "
                f"expected {artifact.sha256}, got {actual}; repair or remove {candidate}",
                sha256=artifact.sha256, actual=actual, source=str(candidate),
                name=artifact.name,
            )
        return count

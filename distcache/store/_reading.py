"""Reading one object's file: opened without following a link, refused when it is not
a regular file, and hashed in chunks first when it is too large to read whole before
its bytes are checked (:data:`LARGE_FILE`). What :mod:`distcache.store._objects`
reads, and what ``pool verify`` and exports check."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time

from distcache._log import get_logger
from distcache.store._fs import (
    READ_FLAGS,
    Witness,
    hash_fd,
    pool_error,
    read_fd,
    trusted_file,
    witness,
)

logger = get_logger(__name__)

# Readers open the fan-out directory rather than walk through it by path: O_NOFOLLOW
# on that component keeps a planted objects/<xx> symlink from being followed.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_fanout(path: str) -> int | None:
    """A descriptor of the fan-out directory ``path``, or None when it is absent or
    not a real directory (a miss for readers; a publisher moves it aside, or fails
    in :func:`make_fanout`). :class:`PoolError` when it cannot be opened."""
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise pool_error("cannot open", path, exc) from exc
    logger.warning("%s is not a directory (a planted symlink?); not following it", path)
    return None



class NotAnObject(Exception):
    """An object's name holds a symlink, a non-file, or a file too large to read
    before it is hashed whose bytes are not its name; ``st`` is its ``fstat``."""

    def __init__(self, reason: str, st: os.stat_result | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.st = st


#: Objects larger than this are hashed in chunks before they are read whole: a huge
#: file put at an object's name is quarantined without ever filling memory. (A good
#: one is hashed twice: the bytes returned are hashed as they are read.)
LARGE_FILE = 1 << 30


def open_object(fanout: str, name: str, path: str) -> tuple[int, os.stat_result] | None:
    """A descriptor and the ``fstat`` of the regular file ``fanout/name`` (at ``path``,
    as messages name it), opened relative to an ``O_NOFOLLOW`` descriptor of
    ``fanout``; None when absent. NotAnObject when it is a symlink or no regular file,
    PoolError when it cannot be opened (permissions, I/O error)."""
    directory = open_fanout(fanout)
    if directory is None:
        return None
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotAnObject("is a symlink", None) from None
        raise pool_error("cannot open object", path, exc) from exc
    finally:
        os.close(directory)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise pool_error("cannot read object", path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotAnObject("is not a regular file", st)
    return fd, st


def read_object(fanout: str, name: str, path: str, stamp_after: float | None,
                known: Witness | None = None
                ) -> tuple[bytes, os.stat_result, bool, os.stat_result | None] | None:
    """The bytes (not yet verified, unless past :data:`LARGE_FILE`) and ``fstat`` of
    the object ``name`` (:func:`open_object`), whether the file was unchanged while
    they were read (looked at only given ``known``: its ``fstat`` after the read is the
    one before), and its ``fstat``
    after a recency stamp (``None``: not stamped; its mtime is refreshed when older
    than ``stamp_after`` seconds), or None when absent; a file ``known`` holds
    (verified, unchanged) is read without the chunked hash. NotAnObject or PoolError
    as :func:`open_object`."""
    opened = open_object(fanout, name, path)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size > LARGE_FILE and not trusted_file(st, known) and hash_fd(
                fd, st.st_size) != (name, st.st_size):
            raise NotAnObject(f"fails verification ({st.st_size} bytes, hashed in chunks)", st)
        data = read_fd(fd, st.st_size)
        # Written in place meanwhile (root, or the owner after a chmod), the bytes read
        # are not those of the file verified: its times tell, and it is hashed. (Bytes
        # not trusted are hashed anyway: no second look.)
        unchanged = known is not None and witness(os.fstat(fd)) == witness(st)
        stamped = None
        if stamp_after is not None and time.time() - st.st_mtime > stamp_after:
            # Another user's object may refuse: recency falls back to publish time.
            with contextlib.suppress(OSError):
                os.utime(fd)
                stamped = os.fstat(fd)
    except OSError as exc:
        raise pool_error("cannot read object", path, exc) from exc
    finally:
        os.close(fd)
    return data, st, unchanged, stamped


def file_holds(path: str | os.PathLike[str], sha: str) -> bool:
    """Whether the regular file ``path`` (not followed if a link) holds the bytes whose
    sha256 is ``sha``, hashed in chunks: never read whole."""
    try:
        fd = os.open(path, READ_FLAGS)
        try:
            size = os.fstat(fd).st_size
            return hash_fd(fd, size) == (sha, size)
        finally:
            os.close(fd)
    except OSError:
        return False

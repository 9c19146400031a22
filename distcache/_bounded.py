"""A file read whole, up to a bound: a manifest, never a stream such as ``/dev/zero``."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def _read_at_most(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; ``OSError`` (``EFBIG``) past ``limit``. A regular file says
    so by its size; anything else (``/dev/zero``) is read, unbuffered, to ``limit + 1``."""
    chunks: list[bytes] = []
    with open(path, "rb", buffering=0) as file:
        st = os.fstat(file.fileno())
        left = limit + 1 if not stat.S_ISREG(st.st_mode) or st.st_size <= limit else 0
        while left > 0 and (chunk := file.read(min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    if left <= 0:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes, the most a manifest may "
                      "hold (MAX_MANIFEST_BYTES): is it the right file?")
    return b"".join(chunks)

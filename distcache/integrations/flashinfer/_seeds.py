"""Installed files the loader reads in FlashInfer's place.

When FlashInfer's ``FLASHINFER_CUBIN_DIR`` is an installed location (an installed
``flashinfer-cubin``), the install points FlashInfer at a writable cache directory
instead; FlashInfer's own function, asked for a name the pool does not serve, would
then no longer see the installed files (it downloads them again, or raises under
``FLASHINFER_NO_DOWNLOAD``). :func:`seed_bytes` reads them first, as FlashInfer itself
would have read them there: the file when its sha256 matches, or whatever it holds
while ``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` is set. Nothing here writes, and nothing
touches a module's state, so concurrent loads need no lock.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distcache.integrations.flashinfer._files import regular_bytes
from distcache.integrations.flashinfer._upstream import checksum_disabled


def escape(file_name: Any) -> str | None:
    """Why joining ``file_name`` onto a directory could leave it (an absolute path, a
    ``..`` segment), or ``None`` when it cannot (other odd names are FlashInfer's)."""
    try:
        name = os.fspath(file_name)
    except TypeError:
        return None
    if not isinstance(name, str):
        return None
    if name.startswith("/"):
        return "absolute path"
    if ".." in name.split("/"):
        return "'..' segment"
    return None


def seed_bytes(seeds: Iterable[Path], file_name: Any, sha256: Any,
               skip: Path | None = None) -> bytes | None:
    """The bytes of ``<seed>/<file_name>`` in the first of ``seeds`` (but ``skip``,
    the directory FlashInfer reads itself) that holds it as FlashInfer would take it:
    its sha256 is ``sha256``, or checksums are disabled. ``None`` when none does, or
    for a name that is not a relative path inside a directory."""
    if not isinstance(file_name, str) or not file_name or escape(file_name) is not None:
        return None
    unchecked = checksum_disabled()
    for seed in seeds:
        if skip is not None and Path(seed) == Path(skip):
            continue
        data = regular_bytes(Path(seed) / file_name)  # a FIFO there would block
        if data is None:
            continue
        if unchecked or hashlib.sha256(data).hexdigest() == sha256:
            return data
    return None

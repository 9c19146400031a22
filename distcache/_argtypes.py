"""Types of command-line values that ``distcache`` and ``python -m launch`` share."""

from __future__ import annotations

import argparse
from pathlib import Path


def directory(text: str) -> str:
    """A directory option's value (``--pool``, ``--workspace``): an empty one (an unset
    shell variable) would be the current directory, and one starting with ``~`` a
    directory named ``~`` there (a shell does not expand it after ``--pool=``), so both
    are refused (an argparse type)."""
    return _named(text, "empty directory name")


def nonblank(text: str) -> str:
    """A file or directory argument's value (``--manifest``, ``SRC``, ``DIR``,
    ``--tar``, ``--record``), refused as :func:`directory` refuses: empty, it would be
    the current directory (``pool import "$WHEEL"`` with WHEEL unset would import it
    whole), and ``~`` is no home directory here (an argparse type)."""
    return _named(text, "empty name (an unset variable?), which would be the current "
                        "directory")


def path(text: str) -> Path:
    """:func:`nonblank` as a :class:`~pathlib.Path` (an argparse type)."""
    return Path(nonblank(text))


def _named(text: str, empty: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(empty)
    if text.startswith("~"):  # the shell leaves it after "--pool=": a directory named ~
        raise argparse.ArgumentTypeError(
            f"{text!r} starts with '~', which only a shell expands (not after '='); "
            "write the absolute path")
    return text

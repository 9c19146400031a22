"""Types of command-line values that ``distcache`` and ``python -m launch`` share."""

from __future__ import annotations

import argparse


def directory(text: str) -> str:
    """A directory option's value (``--pool``, ``--workspace``): an empty one (an unset
    shell variable) would be the current directory, and one starting with ``~`` a
    directory named ``~`` there (a shell does not expand it after ``--pool=``), so both
    are refused (an argparse type)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty directory name")
    if text.startswith("~"):  # the shell leaves it after "--pool=": a directory named ~
        raise argparse.ArgumentTypeError(
            f"{text!r} starts with '~', which only a shell expands (not after '='); "
            "write the directory's absolute path")
    return text

"""One ``DISTCACHE_*``-style variable read on its own, outside the settings' table
(:mod:`distcache.config`), with the table's parsers: a blank value is unset, a bad
one raises :class:`~distcache.errors.ConfigError` naming the variable and the value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from distcache.config import _bool, _int, _seconds, parse_bytes


def _given(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's value, or ``None`` when it is unset or blank."""
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value.strip() == "" else value


def env_str(name: str, default: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value (``""`` included), or ``default`` when unset."""
    value = (os.environ if environ is None else environ).get(name)
    return default if value is None else value


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Parse a boolean variable (1/0, true/false, yes/no, on/off); blank is unset.

    Raises:
        ConfigError: any other value.
    """
    value = _given(name, environ)
    return default if value is None else _bool(name, value)


def env_int(name: str, default: int | None, environ: Mapping[str, str] | None = None, *,
            minimum: int = 0) -> int | None:
    """Parse an integer variable that must be >= ``minimum``; blank is unset.

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    value = _given(name, environ)
    return default if value is None else _int(minimum)(name, value)


def env_float(name: str, default: float | None,
              environ: Mapping[str, str] | None = None) -> float | None:
    """Parse a number of seconds (:func:`check_seconds`); blank is unset."""
    value = _given(name, environ)
    return default if value is None else _seconds(name, value)


def env_bytes(name: str, default: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """Parse a size variable (``64M``, ``1G`` ...); blank is unset.

    Raises:
        ConfigError: not a size.
    """
    value = _given(name, environ)
    return default if value is None else parse_bytes(value, variable=name)

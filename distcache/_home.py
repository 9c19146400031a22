"""The default pool directory, and a default that cannot be worked out.

The default is ``$XDG_CACHE_HOME/distcache``, else ``$HOME/.cache/distcache``, else
the same under the home directory of the user's entry in the password database. Only
absolute directories count: the XDG Base Directory specification says a relative
``XDG_CACHE_HOME`` is to be ignored, and an empty or relative ``HOME`` would put the
pool under whatever directory a command happens to start in. Where none is left there
is no default, which is an error only for a caller that needs the pool and did not
name one: :func:`~distcache.config.settings` keeps it as an :class:`Unresolved`,
raised when the setting is read, so a command given ``--pool`` still runs. A
``DISTCACHE_POOL`` starting with ``~`` is kept so too (:func:`pool_path`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from distcache.errors import ConfigError


def _absolute(value: str | None) -> str | None:
    return value if value and os.path.isabs(value) else None


def _account_home() -> str | None:
    """The home directory of this user's entry in the password database, if any."""
    import pwd  # built in; only a process without HOME gets here

    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid without an entry (a container's arbitrary user)
        return None


def default_pool_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/distcache``, else ``~/.cache/distcache``, from absolute
    directories only (an empty or relative ``XDG_CACHE_HOME`` or ``HOME`` is unset).

    Raises:
        ConfigError: neither names an absolute directory and the user has no home
            directory in the password database.
    """
    env = os.environ if environ is None else environ
    xdg = _absolute(env.get("XDG_CACHE_HOME"))
    if xdg is not None:
        return Path(xdg) / "distcache"
    home = _absolute(env.get("HOME")) or _absolute(_account_home())
    if home is None:
        raise ConfigError(
            "no pool directory: DISTCACHE_POOL is unset, neither XDG_CACHE_HOME nor HOME "
            "names an absolute directory, and this user has no home directory in the "
            "password database; set DISTCACHE_POOL (or HOME), or pass --pool DIR",
            variable="DISTCACHE_POOL", value=None)
    return Path(home) / ".cache" / "distcache"


def pool_path(name: str, raw: str) -> Path | Unresolved:
    """``DISTCACHE_POOL``'s value as a path. One starting with ``~`` is an
    :class:`Unresolved`: only a shell expands ``~``, and taken as written it would make
    a directory named ``~`` wherever a command starts."""
    if raw.startswith("~"):
        return Unresolved(f"{name}={raw!r} starts with '~', which only a shell expands; "
                          "write the directory's absolute path, or pass --pool DIR",
                          name, raw)
    return Path(raw)


class Unresolved(NamedTuple):
    """A default (or a pool directory) that could not be worked out when the settings
    were read; reading the setting raises the error it was, naming ``value`` (a named
    tuple: settings holding one still compare, copy and pickle)."""

    message: str
    variable: str | None
    value: Any = None

    @classmethod
    def of(cls, error: ConfigError) -> Unresolved:
        return cls(str(error), getattr(error, "variable", None))

    def error(self) -> ConfigError:
        return ConfigError(self.message, variable=self.variable, value=self.value)


def defer_fields(cls: type[Any], fields: Iterable[str]) -> None:
    """Make each of ``fields`` of the named tuple ``cls`` raise, when read, the error of
    an :class:`Unresolved` it holds; any other value reads as before."""
    for field in fields:
        setattr(cls, field, _deferred(cls._fields.index(field), getattr(cls, field).__doc__))


def _deferred(index: int, doc: str | None) -> property:
    def read(self: tuple[Any, ...]) -> Any:
        value = tuple.__getitem__(self, index)
        if isinstance(value, Unresolved):
            raise value.error()
        return value

    return property(read, doc=doc)

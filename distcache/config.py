"""Settings: explicit argument > ``DISTCACHE_*`` environment variable > default.

Values are read when :func:`settings` is called, never at import. A bad value raises
:class:`~distcache.errors.ConfigError` naming the variable and the value. ``0`` and
``""`` are real values: nothing here uses ``x or default``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distcache.errors import ConfigError

__all__ = [
    "ENV_VARS",
    "Settings",
    "default_pool_dir",
    "env_bool",
    "env_bytes",
    "env_float",
    "env_int",
    "env_str",
    "parse_bytes",
    "settings",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str, *, variable: str = "value") -> int:
    """Parse ``"512"``, ``"64M"``, ``"1GiB"`` into a byte count.

    Raises:
        ConfigError: the text is not a non-negative size.
    """
    match = _BYTES_RE.match(text)
    if not match:
        raise ConfigError(
            f"{variable}={text!r} is not a size; use bytes or a K/M/G/T suffix (e.g. 64M)",
            variable=variable,
            value=text,
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get(name)


def _given(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's value, or ``None`` when it is unset or blank (then the default
    applies to every typed variable)."""
    value = _raw(name, environ)
    return None if value is None or value.strip() == "" else value


def env_str(name: str, default: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or ``default`` when unset."""
    value = _raw(name, environ)
    return default if value is None else value


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Parse a boolean variable (1/0, true/false, yes/no, on/off).

    Raises:
        ConfigError: any other value.
    """
    value = _given(name, environ)
    if value is None:
        return default
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(
        f"{name}={value!r} is not a boolean; use 1 or 0", variable=name, value=value
    )


def env_int(
    name: str, default: int | None, environ: Mapping[str, str] | None = None, *, minimum: int = 0
) -> int | None:
    """Parse an integer variable that must be >= ``minimum``.

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    value = _given(name, environ)
    if value is None:
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={value!r} is not an integer", variable=name, value=value
        ) from None
    if number < minimum:
        raise ConfigError(
            f"{name}={value!r} must be >= {minimum}", variable=name, value=value
        )
    return number


def env_float(
    name: str, default: float | None, environ: Mapping[str, str] | None = None
) -> float | None:
    """Parse a positive number of seconds.

    Raises:
        ConfigError: not a number, or not positive.
    """
    value = _given(name, environ)
    if value is None:
        return default
    try:
        number = float(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number", variable=name, value=value) from None
    if not number > 0:
        raise ConfigError(f"{name}={value!r} must be > 0", variable=name, value=value)
    return number


def env_bytes(
    name: str, default: int | None, environ: Mapping[str, str] | None = None
) -> int | None:
    """Parse a size variable (``64M``, ``1G`` ...).

    Raises:
        ConfigError: not a size.
    """
    value = _given(name, environ)
    if value is None:
        return default
    return parse_bytes(value, variable=name)


def default_pool_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/distcache``, else ``~/.cache/distcache``."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path(env.get("HOME", str(Path.home()))) / ".cache"
    return base / "distcache"


#: Every variable distcache reads, its default, and its meaning (the README's table).
ENV_VARS: dict[str, tuple[str, str]] = {
    "DISTCACHE_DISABLE": ("0", "1 turns every hook (init, the FlashInfer wrapper) into a no-op"),
    "DISTCACHE_POOL": ("$XDG_CACHE_HOME/distcache", "artifact pool directory"),
    "DISTCACHE_POOL_MAX_BYTES": ("unlimited", "size cap of the pool; LRU objects are collected"),
    "DISTCACHE_ORIGIN": ("unset", "origin URL(s) or directories, comma-separated, tried in order"),
    "DISTCACHE_ORIGIN_TOKEN": ("unset", "bearer token sent to HTTP(S) origins (never logged)"),
    "DISTCACHE_TIMEOUT": ("600", "seconds any collective may take before every rank raises"),
    "DISTCACHE_HTTP_TIMEOUT": ("30", "seconds per HTTP connect/read"),
    "DISTCACHE_HTTP_RETRIES": ("4", "retries per artifact on connection errors, 429 and 5xx"),
    "DISTCACHE_LOCK_TIMEOUT": ("120", "seconds a rank waits for another downloader's lock"),
    "DISTCACHE_BUCKET_BYTES": ("64M", "bytes broadcast per collective when moving artifacts"),
    "DISTCACHE_CHUNK_BYTES": ("1G", "largest single message (must stay under 2 GiB)"),
    "DISTCACHE_DOWNLOADS_PER_RANK": ("4", "concurrent origin downloads per rank"),
    "DISTCACHE_NODE_ID": ("hostname", "node identity used to group ranks"),
    "DISTCACHE_INIT_TIMEOUT": ("300", "seconds launch.init_process_group allows the rendezvous"),
    "DISTCACHE_FLASHINFER": ("1", "0 disables the FlashInfer integration"),
    "DISTCACHE_FLASHINFER_FAMILIES": (
        "*.cubin,*.so,*.h,*/checksums.txt,*.json",
        "comma-separated globs of the FlashInfer artifact names that are pooled",
    ),
}

_TWO_GIB = 2 << 30


@dataclass(frozen=True, slots=True)
class Settings:
    """Resolved settings. Build with :func:`settings`."""

    #: Disable every hook.
    disable: bool
    #: Pool directory.
    pool_dir: Path
    #: Pool size cap in bytes, or ``None`` for unlimited.
    pool_max_bytes: int | None
    #: Origins tried in order (URLs or directories); empty when unset.
    origins: tuple[str, ...]
    #: Bearer token for HTTP(S) origins.
    origin_token: str | None
    #: Seconds a collective may take.
    timeout: float
    #: Seconds per HTTP connect/read.
    http_timeout: float
    #: Retries per artifact.
    http_retries: int
    #: Seconds to wait for another downloader's lock.
    lock_timeout: float
    #: Bytes per broadcast bucket.
    bucket_bytes: int
    #: Largest single message.
    chunk_bytes: int
    #: Concurrent downloads per rank.
    downloads_per_rank: int
    #: Node identity override, or ``None`` for the hostname.
    node_id: str | None
    #: FlashInfer integration enabled.
    flashinfer: bool

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def settings(environ: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
    """Resolve settings: explicit keyword > ``DISTCACHE_*`` variable > default.

    A keyword given as ``None`` counts as not given.

    Raises:
        ConfigError: a variable or keyword has a bad value, or an unknown keyword.
    """
    fields = {f.name for f in dataclasses.fields(Settings)}
    unknown = set(explicit) - fields
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {sorted(unknown)}; known: {sorted(fields)}",
            variable=",".join(sorted(unknown)),
            value=None,
        )
    given = {k: v for k, v in explicit.items() if v is not None}
    origins_raw = env_str("DISTCACHE_ORIGIN", None, environ)
    origins = tuple(o.strip() for o in origins_raw.split(",") if o.strip()) if origins_raw else ()
    pool_raw = env_str("DISTCACHE_POOL", None, environ)
    resolved: dict[str, Any] = {
        "disable": env_bool("DISTCACHE_DISABLE", False, environ),
        "pool_dir": Path(pool_raw) if pool_raw else default_pool_dir(environ),
        "pool_max_bytes": env_bytes("DISTCACHE_POOL_MAX_BYTES", None, environ),
        "origins": origins,
        "origin_token": env_str("DISTCACHE_ORIGIN_TOKEN", None, environ) or None,
        "timeout": env_float("DISTCACHE_TIMEOUT", 600.0, environ),
        "http_timeout": env_float("DISTCACHE_HTTP_TIMEOUT", 30.0, environ),
        "http_retries": env_int("DISTCACHE_HTTP_RETRIES", 4, environ),
        "lock_timeout": env_float("DISTCACHE_LOCK_TIMEOUT", 120.0, environ),
        "bucket_bytes": env_bytes("DISTCACHE_BUCKET_BYTES", 64 << 20, environ),
        "chunk_bytes": env_bytes("DISTCACHE_CHUNK_BYTES", 1 << 30, environ),
        "downloads_per_rank": env_int("DISTCACHE_DOWNLOADS_PER_RANK", 4, environ, minimum=1),
        "node_id": env_str("DISTCACHE_NODE_ID", None, environ) or None,
        "flashinfer": env_bool("DISTCACHE_FLASHINFER", True, environ),
    }
    resolved.update(given)
    if isinstance(resolved["origins"], str):
        resolved["origins"] = (resolved["origins"],)
    resolved["origins"] = tuple(resolved["origins"])
    resolved["pool_dir"] = Path(resolved["pool_dir"])
    chunk = resolved["chunk_bytes"]
    if not 0 < chunk < _TWO_GIB:
        raise ConfigError(
            f"DISTCACHE_CHUNK_BYTES={chunk} must be between 1 and 2 GiB - 1",
            variable="DISTCACHE_CHUNK_BYTES",
            value=chunk,
        )
    if resolved["bucket_bytes"] <= 0:
        raise ConfigError(
            f"DISTCACHE_BUCKET_BYTES={resolved['bucket_bytes']} must be > 0",
            variable="DISTCACHE_BUCKET_BYTES",
            value=resolved["bucket_bytes"],
        )
    return Settings(**resolved)

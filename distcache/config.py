"""Settings: explicit argument > ``DISTCACHE_*`` environment variable > default.

Every variable is one row of :data:`TABLE` (variable, setting, default, parser,
meaning); :func:`settings` reads the table, and :data:`ENV_VARS` (the README's table)
is derived from it. Values are read when :func:`settings` is called, never at import.
A bad value raises :class:`~distcache.errors.ConfigError` naming the variable and the
value. ``0`` and ``""`` are real values: nothing here uses ``x or default``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from distcache._home import Unresolved, default_pool_dir, defer_fields, pool_path
from distcache._settings_lists import _globs, _list, _origins
from distcache.errors import ConfigError

__all__ = ["ENV_VARS", "TABLE", "Settings", "Variable", "check_seconds", "default_pool_dir",
           "parse_bytes", "setting", "settings"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
#: The largest count a setting may ask for (threads, retries): far beyond any real one,
#: and within what the ranks exchange to agree on their download counts.
MAX_COUNT = 1_000_000
#: The largest size a setting may give: the largest file offset (``off_t``).
MAX_BYTES = (1 << 63) - 1


def parse_bytes(text: str, *, variable: str = "value", least: int = 0) -> int:
    """Parse ``"512"``, ``"64M"``, ``"1GiB"`` into a byte count of at least ``least``.

    Raises:
        ConfigError: the text is not a size, or one below ``least`` or above
            :data:`MAX_BYTES`.
    """
    match = _BYTES_RE.match(text)
    if not match:
        raise ConfigError(f"{variable}={text!r} is not a size; use bytes or a K/M/G/T suffix "
                          "(e.g. 64M)", variable=variable, value=text)
    digits = match.group(1).lstrip("0") or "0"
    # Past 8 EiB no file or filesystem holds it (and past 4,300 digits int() refuses).
    number = int(digits) * _UNITS[match.group(2).lower()] if len(digits) <= 19 else None
    if number is None or number > MAX_BYTES:
        raise ConfigError(f"{variable}={text[:40]!r} is more bytes than any filesystem holds "
                          f"(at most {MAX_BYTES}, 8 EiB)", variable=variable, value=text)
    if number < least:
        raise ConfigError(f"{variable}={text!r} must be at least {least} byte(s)",
                          variable=variable, value=text)
    return number


# --- parsers: (variable name, raw text) -> value ------------------------------------


#: Values of ``DISTCACHE_TRANSPORT`` / ``init(transport=...)``.
TRANSPORTS = ("default", "nccl")


def _bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0", variable=name, value=raw)


def _int(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            number = int(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer", variable=name,
                              value=raw) from None
        if not minimum <= number <= MAX_COUNT:
            raise ConfigError(f"{name}={raw!r} must be >= {minimum} and at most {MAX_COUNT:,}",
                              variable=name, value=raw)
        return number

    return parse


#: The longest wait a setting may ask for (about 11.6 days): far beyond any real one,
#: and within what every wait downstream takes (an int32 of milliseconds, a socket's
#: timeout, a deadline as a timestamp).
MAX_SECONDS = 1_000_000.0


def check_seconds(value: object, *, what: str, text: bool = True) -> float:
    """``value`` as seconds, a number above 0 and at most :data:`MAX_SECONDS`: a text is
    parsed when ``text`` (a variable, an option), never otherwise; ``what`` names it
    (``""``: argparse does).

    Raises:
        ConfigError: not a number, or not one above 0 and at most :data:`MAX_SECONDS`.
    """
    number: float | None = None
    if text and isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value.strip())
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = value  # not numpy's ints or Fraction: the waits downstream take floats
    # Infinity and huge numbers are refused: the waits downstream overflow on them.
    if number is not None and 0 < number <= MAX_SECONDS:
        return float(number)
    shown = f"{what}={value!r}" if what else repr(value)
    why = ("is not a number" if number is None else
           f"must be a number of seconds above 0 and at most {MAX_SECONDS:,.0f}")
    raise ConfigError(f"{shown} {why}", variable=what or None, value=value)


def _seconds(name: str, raw: str) -> float:
    return check_seconds(raw, what=name)


def _bytes(name: str, raw: str) -> int:
    return parse_bytes(raw, variable=name)


def _text(name: str, raw: str) -> str:
    return raw


def _transport(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in TRANSPORTS:
        raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(TRANSPORTS)}",
                          variable=name, value=raw)
    return value


def _peers(name: str, raw: str) -> str:
    """``0``, ``1`` (spaces around them ignored), or a socket path (it holds a ``/``)."""
    value = raw.strip()
    if value in ("0", "1"):
        return value
    if "/" not in raw:
        raise ConfigError(f"{name}={raw!r}: expected 0, 1 or the path of a node agent's "
                          "socket", variable=name, value=raw)
    return raw


def _path(name: str, raw: str) -> Path:
    return Path(raw)


# --- the table ----------------------------------------------------------------------
# A blank variable (``VAR=``) counts as unset for a setting whose type has no empty
# value (numbers, booleans, sizes, paths, names); a list setting reads it as the empty
# list. Every other text, ``0`` included, is a value and is parsed as one.


class Variable(NamedTuple):
    """One row of the table (read-only): the variable, the :class:`Settings` field it sets, its
    default (a value, or a function of the environment), how it is parsed, what it means."""

    name: str
    field: str
    default: Any
    parse: Callable[[str, str], Any]
    shown: str
    doc: str
    #: Blank means "unset" (see the note above the table).
    blank_is_unset: bool = True
    #: How an explicit keyword's value is checked; ``None`` takes it as given (its
    #: caller checks it: ``ArtifactPool(lock_timeout=0)`` means not to wait).
    check: Callable[[Variable, Any], Any] | None = None

    def read(self, environ: Mapping[str, str]) -> Any:
        """The parsed value, or the default when the variable is unset; a default that
        cannot be worked out is kept as an :class:`Unresolved`, raised when read.

        Raises:
            ConfigError: the value does not parse.
        """
        raw = environ.get(self.name)
        if raw is not None and not isinstance(raw, str):
            raise ConfigError(f"{self.name}={raw!r} is not a string; environ must be a "
                              "mapping of strings", variable=self.name, value=raw)
        if raw is not None and not (self.blank_is_unset and raw.strip() == ""):
            return self.parse(self.name, raw)
        try:
            return self.default(environ) if callable(self.default) else self.default
        except ConfigError as exc:
            return Unresolved.of(exc)

    def take(self, given: Any) -> Any:
        """An explicit keyword's value (not ``None``), as :attr:`check` lets it through."""
        return given if self.check is None else self.check(self, given)


def _given_seconds(variable: Variable, given: Any) -> float:
    return check_seconds(given, what=variable.field, text=False)


def _given_int(variable: Variable, given: Any) -> int:
    """An integer keyword, held to the minimum its variable's parse holds text to."""
    if type(given) is not int:
        raise ConfigError(f"{variable.field}={given!r} is not an integer",
                          variable=variable.field, value=given)
    try:
        return int(variable.parse(variable.name, str(given)))
    except ConfigError as exc:
        raise ConfigError(f"{variable.field}={given!r} is out of range ({exc})",
                          variable=variable.field, value=given) from None


def _given_transport(variable: Variable, given: Any) -> str:
    """A ``transport=`` keyword, checked as its variable is and named as the keyword."""
    value = given.strip().lower() if isinstance(given, str) else None
    if value in TRANSPORTS:
        return value
    raise ConfigError(f"{variable.field}={given!r}: expected one of {', '.join(TRANSPORTS)} "
                      f"(the values of {variable.name})", variable=variable.field, value=given)


#: Every variable distcache reads: one row each, in the README's order.
TABLE: tuple[Variable, ...] = (
    Variable("DISTCACHE_DISABLE", "disable", False, _bool, "0",
             "1 turns every hook (init, the FlashInfer wrapper) into a no-op"),
    Variable("DISTCACHE_POOL", "pool_dir", default_pool_dir, pool_path,
             "$XDG_CACHE_HOME/distcache", "artifact pool directory"),
    Variable("DISTCACHE_POOL_MAX_BYTES", "pool_max_bytes", None, _bytes, "unlimited",
             "size cap of the pool; LRU objects are collected"),
    Variable("DISTCACHE_ORIGIN", "origins", (), _origins, "unset",
             "origin URL(s) or directories, comma-separated, tried in order",
             blank_is_unset=False),
    Variable("DISTCACHE_ORIGIN_TOKEN", "origin_token", None, _text, "unset",
             "bearer token sent only to the host of the first http(s) entry of "
             "DISTCACHE_ORIGIN (never logged)"),
    Variable("DISTCACHE_ORIGIN_TOKENS", "origin_tokens", None, _text, "unset",
             "bearer tokens per host: host[:port]=token,... (never logged)"),
    Variable("DISTCACHE_MAX_ARTIFACT_BYTES", "max_artifact_bytes", 4 << 30,
             lambda name, raw: parse_bytes(raw, variable=name, least=1), "4G",
             "largest body accepted for an artifact of unknown size"),
    Variable("DISTCACHE_TIMEOUT", "timeout", 600.0, _seconds, "600",
             "seconds a rank waits for a peer, and a rank's downloads may go without "
             "progress, before every rank raises; progress extends a fetch",
             check=_given_seconds),
    Variable("DISTCACHE_HTTP_TIMEOUT", "http_timeout", 30.0, _seconds, "30",
             "seconds per HTTP connect/read"),
    Variable("DISTCACHE_HTTP_RETRIES", "http_retries", 4, _int(0), "4",
             "retries per artifact on connection errors, 429 and 5xx", check=_given_int),
    Variable("DISTCACHE_LOCK_TIMEOUT", "lock_timeout", 120.0, _seconds, "120",
             "seconds a rank waits for another downloader's lock"),
    Variable("DISTCACHE_BUCKET_BYTES", "bucket_bytes", 64 << 20, _bytes, "64M",
             "bytes broadcast per collective when moving artifacts"),
    Variable("DISTCACHE_CHUNK_BYTES", "chunk_bytes", 1 << 30, _bytes, "1G",
             "largest single message (must stay under 2 GiB)"),
    Variable("DISTCACHE_DOWNLOADS_PER_RANK", "downloads_per_rank", 4, _int(1), "4",
             "concurrent origin downloads per rank (a node leader: up to its node's)",
             check=_given_int),
    Variable("DISTCACHE_DOWNLOADS_PER_JOB", "downloads_per_job", 32, _int(1), "32",
             "concurrent origin downloads over the whole job, carried by as few ranks "
             "as the per-rank count allows; set it to what a rate-limiting origin allows",
             check=_given_int),
    Variable("DISTCACHE_NODE_ID", "node_id", None, _text, "hostname",
             "node identity used to group ranks"),
    Variable("DISTCACHE_TRANSPORT", "transport", "default", _transport, "default",
             "how the prefetch moves bulk bytes: default (over MPI or gloo) or nccl (a "
             "dedicated NCCL group made for the prefetch and destroyed after it)",
             check=_given_transport),
    Variable("DISTCACHE_INIT_TIMEOUT", "init_timeout", 300.0, _seconds, "300",
             "seconds launch.init_process_group allows the rendezvous", check=_given_seconds),
    Variable("DISTCACHE_FLASHINFER", "flashinfer", True, _bool, "1",
             "0 disables the FlashInfer integration"),
    Variable("DISTCACHE_FLASHINFER_FAMILIES", "flashinfer_families", None, _globs,
             "*.cubin,*.so,*.h,*/checksums.txt,*.json",
             "comma-separated globs of the FlashInfer artifact names that are pooled",
             blank_is_unset=False),
    Variable("DISTCACHE_JIT_CACHES", "jit_caches", (), _list, "unset", "JIT caches pooled"),
    Variable("DISTCACHE_LOG_JSON", "log_json", None, _path, "unset",
             "file that structured events (prefetch reports, loader statistics) are "
             "appended to, one JSON line each"),
    Variable("DISTCACHE_OFFLINE", "offline", False, _bool, "0",
             "1: no origin is contacted, by distcache or by FlashInfer's loader behind it; "
             "a pool miss is an error naming the artifact"),
    Variable("DISTCACHE_AUTOINSTALL", "autoinstall", False, _bool, "0",
             "1: the start-up hook installed with the package puts the FlashInfer wrapper "
             "into every Python process (workers an engine spawns itself)"),
    Variable("DISTCACHE_PEERS", "peers", "1", _peers, "1", "0: a pool miss goes to the origin; 1: under init, ask the node agents first; a socket path: the node agent python -m launch --peers hosts (it sets this)"),
)

#: ``variable -> (default as documented, meaning)``: the README's table, from :data:`TABLE`.
ENV_VARS: dict[str, tuple[str, str]] = {v.name: (v.shown, v.doc) for v in TABLE}

_TWO_GIB = 2 << 30


class Settings(NamedTuple):
    """Resolved settings, immutable (a named tuple: cheap to import, unlike a dataclass
    of as many fields). Build with :func:`settings`; one row of :data:`TABLE` each."""

    disable: bool  #: Disable every hook.
    pool_dir: Path  #: Pool directory; ConfigError when read where it has no (good) value.
    pool_max_bytes: int | None  #: Pool size cap in bytes, or ``None`` for unlimited.
    origins: tuple[str, ...]  #: Origins tried in order (URLs or directories); empty when unset.
    origin_token: str | None  #: Bearer token for the first HTTP(S) origin (never in ``repr``).
    #: Bearer tokens per host (``host[:port]=token,...``), unparsed (never in ``repr``).
    origin_tokens: str | None
    max_artifact_bytes: int  #: Largest body accepted for an artifact of unknown size.
    timeout: float  #: Seconds a collective may take.
    http_timeout: float  #: Seconds per HTTP connect/read.
    http_retries: int  #: Retries per artifact.
    lock_timeout: float  #: Seconds to wait for another downloader's lock.
    bucket_bytes: int  #: Bytes per broadcast bucket.
    chunk_bytes: int  #: Largest single message.
    downloads_per_rank: int  #: Concurrent downloads per rank.
    downloads_per_job: int  #: Concurrent downloads over the whole job.
    node_id: str | None  #: Node identity override, or ``None`` for the hostname.
    transport: str  #: How the prefetch moves bulk bytes: ``"default"`` or ``"nccl"``.
    init_timeout: float  #: Seconds ``launch.init_process_group`` allows the rendezvous.
    flashinfer: bool  #: FlashInfer integration enabled.
    #: Globs of the FlashInfer names that are pooled, or ``None``: the integration's own.
    flashinfer_families: tuple[str, ...] | None
    jit_caches: tuple[str, ...]  #: JIT caches init fills and Session.sync publishes.
    log_json: Path | None  #: File structured events are appended to, or ``None``.
    offline: bool  #: Never contact an origin.
    autoinstall: bool  #: The start-up hook installs the FlashInfer wrapper in every process.
    peers: str  #: "0", "1", or the Unix socket of the node's agent (see docs/peers.md).

    def replace(self, **changes: Any) -> Settings:
        return self._replace(**changes)

    def __repr__(self) -> str:  # never the tokens, nor an origin URL's user-info or query
        from distcache._urls import redact_url  # at the first repr

        shown = self._replace(origins=tuple(map(redact_url, self.origins)))
        return "Settings(" + ", ".join(f"{name}={value!r}" for name, value in zip(
            self._fields, shown, strict=True) if name not in ("origin_token", "origin_tokens")) + ")"


# A field whose default is worked out (the pool directory) raises, when read, the error
# its default met; a caller that never reads it (a command given --pool) runs.
defer_fields(Settings, [v.field for v in TABLE if callable(v.default)])
_FIELDS = frozenset(Settings._fields)
_ROWS = {v.field: v for v in TABLE}


def setting(field: str, environ: Mapping[str, str] | Settings | None = None,
            given: Any = None) -> Any:
    """One setting as :func:`settings` gives it, read alone (for a check made once per
    artifact, or an object that uses a few): ``given`` checked as a keyword, unless
    ``None``; else ``environ``'s field where it is a :class:`Settings`, else its variable.

    Raises:
        ConfigError: the variable (or ``given``) has a bad value.
    """
    row = _ROWS[field]
    if given is not None or isinstance(environ, Settings):
        return row.take(given) if given is not None else getattr(environ, field)
    return row.read(os.environ if environ is None else environ)


def settings(environ: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
    """Resolve settings: explicit keyword > ``DISTCACHE_*`` variable > default.

    A keyword given as ``None`` counts as not given.

    Raises:
        ConfigError: a variable or keyword has a bad value, or an unknown keyword.
    """
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise ConfigError(f"environ must be a mapping of strings, not {env!r}"[:200],
                          variable="environ", value=repr(env)[:120])
    unknown = set(explicit) - _FIELDS
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(_FIELDS)}",
                          variable=",".join(sorted(unknown)), value=None)
    resolved: dict[str, Any] = {}
    for variable in TABLE:
        given = explicit.get(variable.field)
        resolved[variable.field] = variable.read(env) if given is None else variable.take(given)
    if isinstance(resolved["origins"], str):
        resolved["origins"] = (resolved["origins"],)
    resolved["origins"] = tuple(resolved["origins"])
    if not isinstance(resolved["pool_dir"], Unresolved):
        resolved["pool_dir"] = Path(resolved["pool_dir"])
    chunk = resolved["chunk_bytes"]
    if not 0 < chunk < _TWO_GIB:
        raise ConfigError(f"DISTCACHE_CHUNK_BYTES={chunk} must be between 1 and 2 GiB - 1",
                          variable="DISTCACHE_CHUNK_BYTES", value=chunk)
    if resolved["bucket_bytes"] <= 0:
        raise ConfigError(f"DISTCACHE_BUCKET_BYTES={resolved['bucket_bytes']} must be > 0",
                          variable="DISTCACHE_BUCKET_BYTES", value=resolved["bucket_bytes"])
    return Settings(**resolved)

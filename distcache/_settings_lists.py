"""The comma-separated list settings of :mod:`distcache.config`: the origins, the JIT
caches, the FlashInfer globs. Parsers: ``(variable name, raw text) -> value``."""

from __future__ import annotations

from distcache.errors import ConfigError


def _list(name: str, raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _globs(name: str, raw: str) -> tuple[str, ...]:
    globs = _list(name, raw)
    if not globs:
        raise ConfigError(
            f"{name} is set but lists no glob; unset it or list globs such as '*.cubin'",
            variable=name, value=raw,
        )
    return globs


def refuse_empty_entry(name: str, raw: str) -> None:
    """Refuse a list of origins ``raw`` (from ``name``) with an empty entry in it: two
    commas in a row, a comma at either end, or an entry of spaces alone. Such an entry
    is most often a variable that expanded to nothing (``$MIRROR,https://cdn``), and
    dropping it would send every download to the origins that are left. A value that
    is blank as a whole lists no origin and is not refused here.

    Raises:
        ConfigError: naming ``name``, the value (its URLs' user-info and queries
            redacted) and the position of the first empty entry.
    """
    entries = raw.split(",")
    if not raw.strip() or all(entry.strip() for entry in entries):
        return
    from distcache._urls import redact_url  # only for the message

    position = next(i for i, entry in enumerate(entries, 1) if not entry.strip())
    # Each entry's user-info and query redacted, its spaces kept as written.
    shown = ",".join(entry.replace(entry.strip(), redact_url(entry.strip()), 1)
                     if entry.strip() else entry for entry in entries)
    raise ConfigError(
        f"{name}={shown!r}: entry {position} of {len(entries)} is empty (two commas in a "
        "row, a comma at an end, or only spaces); remove the extra comma, or set the "
        "variable that was to fill it in (e.g. MIRROR in \"$MIRROR,https://cdn.example\")",
        variable=name, value=shown)


def _origins(name: str, raw: str) -> tuple[str, ...]:
    """``DISTCACHE_ORIGIN``: the origins in order; empty when the value is blank."""
    refuse_empty_entry(name, raw)
    return _list(name, raw)

"""Run by ``distcache-autoinstall.pth`` at interpreter start when
``DISTCACHE_AUTOINSTALL`` is set: arms the FlashInfer wrapper and reports what it did
to ``DISTCACHE_LOG_JSON`` (see :mod:`distcache.integrations._autoinstall`). Importing
it never raises and never imports FlashInfer or torch.

Every Python process of the environment runs this, so it decides from the
environment alone, before importing anything, when there is nothing to do: the hook
is off (``DISTCACHE_AUTOINSTALL`` false), or ``DISTCACHE_DISABLE`` is true and there
is no ``DISTCACHE_LOG_JSON`` to report the disabled hook to. Any other value goes
through :func:`distcache.config.settings`, which reports a bad one.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def _nothing_to_do() -> bool:
    """Whether the hook has nothing to do or report, read without importing."""
    if _flag("DISTCACHE_AUTOINSTALL") in _FALSE:
        return True
    return _flag("DISTCACHE_DISABLE") in _TRUE and not os.environ.get(
        "DISTCACHE_LOG_JSON", "").strip()


def _start() -> None:
    if _nothing_to_do():
        return
    from distcache.integrations._autoinstall import FAILED, STARTUP, arm, report

    try:
        from distcache.config import settings

        if settings().autoinstall:
            arm(STARTUP)
    except Exception as exc:  # a bad value must not break interpreter start
        import logging

        logging.getLogger(__name__).warning("distcache start-up hook: %s", exc)
        report(STARTUP, FAILED, error=f"{type(exc).__name__}: {exc}")


_start()

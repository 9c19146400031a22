"""Run by ``distcache-autoinstall.pth`` at interpreter start when
``DISTCACHE_AUTOINSTALL`` is set: arms the FlashInfer wrapper and reports what it did
to ``DISTCACHE_LOG_JSON`` (see :mod:`distcache.integrations._autoinstall`). Importing
it never raises and never imports FlashInfer or torch."""

from __future__ import annotations

from distcache.integrations._autoinstall import FAILED, arm, report


def _start() -> None:
    try:
        from distcache.config import settings

        if settings().autoinstall:
            arm("startup")
    except Exception as exc:  # a bad value must not break interpreter start
        import logging

        logging.getLogger(__name__).warning("distcache start-up hook: %s", exc)
        report("startup", FAILED, error=f"{type(exc).__name__}: {exc}")


_start()

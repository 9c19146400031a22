"""The library's loggers, with :mod:`logging` loaded only when a record can be shown.

Every rank of a job imports distcache, and the standard ``logging`` package costs
milliseconds of CPU to import (it brings ``traceback``, ``string``, ``tokenize`` and
more), on a machine whose cores the whole job shares. A :class:`Logger` here is
``logging.getLogger(name)`` for every purpose, but it imports ``logging`` only when
it has to: records at ``WARNING`` and above always go to the real logger, and a
record below ``WARNING`` goes to it whenever ``logging`` is loaded (by the
application, a test runner, an engine, or an earlier warning). While it is not
loaded, nothing can have configured a handler or a level, and the default
configuration (the root logger at ``WARNING``) would drop the record: it is
dropped without loading ``logging``.

Records name the caller's file, line and function, as the real logger's do.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging

DEBUG = 10
INFO = 20
WARNING = 30
ERROR = 40

# The frames between the caller and logging: Logger.<level>, then Logger._emit.
_STACKLEVEL = 3


class Logger:
    """``logging.getLogger(name)``, loaded on demand (see the module's doc)."""

    __slots__ = ("_real", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._real: logging.Logger | None = None

    @property
    def real(self) -> logging.Logger:
        """The standard logger of this name (loads ``logging``)."""
        real = self._real
        if real is None:
            import logging

            real = self._real = logging.getLogger(self.name)
        return real

    def _emit(self, level: int, msg: object, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> None:
        if level < WARNING and "logging" not in sys.modules:
            return
        kwargs.setdefault("stacklevel", _STACKLEVEL)
        self.real.log(level, msg, *args, **kwargs)

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self._emit(DEBUG, msg, args, kwargs)

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self._emit(INFO, msg, args, kwargs)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self._emit(WARNING, msg, args, kwargs)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self._emit(ERROR, msg, args, kwargs)

    def exception(self, msg: object, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self._emit(ERROR, msg, args, kwargs)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        self._emit(level, msg, args, kwargs)

    def __repr__(self) -> str:
        return f"<distcache logger {self.name!r}>"


def get_logger(name: str) -> Logger:
    """The logger of ``name`` (``__name__`` of the module that logs)."""
    return Logger(name)

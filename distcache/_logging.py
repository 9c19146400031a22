"""Logging for the programs distcache ships (the ``distcache`` command and
``python -m launch``); the library itself only logs.

The rule, for a job of many ranks writing to one terminal or one log file: by
default rank 0 prints its progress (one line per phase) and every rank prints its
warnings and errors (a command that is not collective prints only its warnings); ``-v`` prints every rank's progress and debug lines, each
tagged with its rank. Each record is written once: the handler sits on the
``distcache`` (and ``launch``) loggers, which stop propagating to the root logger
while it is installed, so an application that also configures logging does not
print the same line a second time.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from typing import TextIO

#: The loggers the programs configure: the library's and the launch wrapper's.
LOGGERS = ("distcache", "launch")
#: Third-party loggers kept quiet unless ``-vv``: urllib3 logs every connection.
_NOISY = ("urllib3",)
#: A URL in a message (``scheme://`` to the next blank or quote).
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s'"<>]+""")
#: The query (and fragment) of a path quoted without its host: ``GET /f?sig=...``.
_QUERY = re.compile(r"""(?<=[^\s'"<>])[?#][^\s'"<>]*""")


def _redact_urls(text: str) -> str:
    """``text`` with each URL shown by :func:`~distcache._urls.redact_url` (no user-info,
    no query) and the query cut from every other path."""
    from distcache._urls import redact_url  # with the first connection line

    return _QUERY.sub("", _URL.sub(lambda url: redact_url(url.group()), text))


class _RedactFilter(logging.Filter):
    """Rewrites the records of the :data:`_NOISY` loggers without the user-info and
    queries of the URLs they quote: urllib3 logs each request's full path, and a signed
    URL carries its secret in the query. Their tracebacks are dropped, for the same
    reason; other records pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.partition(".")[0] in _NOISY:
            record.msg, record.args = _redact_urls(record.getMessage()), None
            record.exc_info = record.exc_text = record.stack_info = None
        return True


class _RankFilter(logging.Filter):
    """Lets progress (INFO and below) through only where it should be printed, and
    tags each record with the rank."""

    def __init__(self, verbose: int, rank: int | None) -> None:
        super().__init__()
        self.verbose = verbose
        self.rank = rank
        self.tag = "" if rank is None else f"rank {rank}: "

    def filter(self, record: logging.LogRecord) -> bool:
        record.distcache_rank = self.tag
        if record.levelno >= logging.WARNING or self.verbose > 0:
            return True
        return self.rank == 0


class _Formatter(logging.Formatter):
    """``distcache: <message>`` for progress, ``distcache: WARNING: <message>`` for
    the rest; ``rank N: `` after the prefix under a launcher (rank 0 only with -v)."""

    def __init__(self, verbose: int) -> None:
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        tag = getattr(record, "distcache_rank", "")
        if tag == "rank 0: " and self.verbose == 0 and record.levelno < logging.WARNING:
            tag = ""  # only rank 0 prints progress: no tag needed to tell ranks apart
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        text = f"distcache: {tag}{level}{record.getMessage()}"
        if record.exc_info and self.verbose > 0:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted: a handler left
    behind by an in-process caller never writes into a stream that was swapped out
    and closed since (a test's captured stderr, say)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


# The rank and verbosity the last configure_logging call was given (rank None: not
# collective).
_rank: list[int | None] = [None]
_verbose: list[int] = [0]


def reports_error(exc: BaseException, rank: int | None = None) -> bool:
    """Whether this process prints ``exc``: not on a rank other than 0 when every rank
    raised that same error (``DistcacheError.agreed``), so that a job prints one line,
    not one per rank. ``rank`` defaults to the one logging was configured with; with
    ``-v`` every rank prints it."""
    rank = _rank[0] if rank is None else rank
    return not (getattr(exc, "agreed", False) and rank not in (None, 0) and not _verbose[0])


def error_line(program: str, exc: BaseException, text: str | None = None, *,
               rank: int | None = None) -> str | None:
    """``program: error: TEXT`` for ``exc`` (``text``: its message made one line by the
    caller), or ``None`` where another rank prints it (:func:`reports_error`)."""
    if not reports_error(exc, rank):
        return None
    return f"{program}: error: {str(exc) if text is None else text}"


def configure_logging(
    verbose: int, rank: int | None, *, stream: TextIO | None = None
) -> Callable[[], None]:
    """Print distcache's log records on ``stream`` (default: stderr).

    ``verbose`` 0: progress (INFO) from rank 0 only, WARNING and above from every
    rank; ``rank`` None is a command that is not collective, whose result is what it
    prints on stdout, so only its warnings. 1: DEBUG from every rank. 2 or more: also
    the HTTP library's connection lines. Calling it again replaces the earlier set-up
    (the CLI learns the rank only once a collective command joins the job).

    Returns:
        A function that restores the loggers as they were before the first call
        (calling :func:`distcache.cli.main` in-process leaves logging as it was).
    """
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(_Formatter(verbose))
    handler.addFilter(_RankFilter(verbose, rank))
    handler.addFilter(_RedactFilter())
    handler.set_name("distcache")
    level = logging.DEBUG if verbose > 0 else logging.INFO
    loggers = [logging.getLogger(name) for name in LOGGERS]
    noisy = [logging.getLogger(name) for name in _NOISY]
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in loggers + noisy]
    for lg in loggers + noisy:
        for old in [h for h in lg.handlers if h.get_name() == "distcache"]:
            lg.removeHandler(old)
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(level)
        lg.propagate = False
    for lg in noisy:
        lg.setLevel(logging.DEBUG if verbose > 1 else logging.ERROR)
        if verbose > 1:  # printed by the same handler, redacted; not a second time by root
            lg.addHandler(handler)
            lg.propagate = False
    saved_rank, saved_verbose = _rank[0], _verbose[0]
    _rank[0], _verbose[0] = rank, verbose

    def restore() -> None:
        _rank[0], _verbose[0] = saved_rank, saved_verbose
        for lg, old_level, old_propagate, old_handlers in saved:
            for h in list(lg.handlers):
                lg.removeHandler(h)
            for h in old_handlers:
                lg.addHandler(h)
            lg.setLevel(old_level)
            lg.propagate = old_propagate

    return restore

"""What the HTTP origin tests share: starting raw servers for a test and closing them,
and closing every origin a test opened (pooled connections left to the garbage
collector are ResourceWarnings, which the suite treats as errors)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar


class Closing(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=Closing)


def started(make: Callable[[Any], S]) -> Iterator[Callable[[Any], S]]:
    """A fixture's body: a function starting ``make(respond)`` servers, each closed when
    the test ends."""
    servers: list[S] = []

    def start(respond: Any) -> S:
        servers.append(make(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def close_all(opened: list[Any]) -> None:
    """Close every origin in ``opened`` (emptying it), then collect what a refused
    response left to the garbage collector (urllib3 closes the socket of a response it
    refused before handing it on only then), its warning silenced here rather than
    landing in a later test."""
    while opened:
        opened.pop().close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()

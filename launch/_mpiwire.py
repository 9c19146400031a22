"""The launcher's two MPI exchanges (host names, then rank 0's rendezvous address),
without pickle.

mpi4py's lower-case ``allgather``/``bcast`` pickle what they send and unpickle what
they receive, so a peer could make this rank run code. These send UTF-8 JSON through
the buffer calls (``Allgather``/``Allgatherv``/``Bcast``) instead and check the shape of
what arrives: JSON decodes to plain data only. Each call is started non-blocking and
waited for within the rendezvous's timeout, where one is given: a rank that never
arrives is a :class:`~distcache.errors.CollectiveTimeout`, not a wait for ever (MPI's
blocking calls also spin a core meanwhile).
"""

from __future__ import annotations

import json
import time
from array import array
from typing import Any

from distcache.errors import CollectiveTimeout, CommError

#: The largest message either exchange accepts from a peer (a host name, an address).
MAX_MESSAGE_BYTES = 4096


#: Requests given up on at their deadline, with their buffers: MPI may still complete
#: them (a late rank), writing into those buffers, which must stay alive until exit.
_ABANDONED: list[tuple[Any, Any]] = []


def _waited(request: Any, keep: Any, op: str, timeout: float | None) -> None:
    """Wait for ``request`` (``keep``: the buffers it reads or writes) at most
    ``timeout`` seconds (None: as long as it takes).

    Raises:
        CollectiveTimeout: it did not complete in time.
    """
    if timeout is None:
        request.Wait()
        return
    from distcache.comm._base import poll_until

    if not poll_until(request.Test, time.monotonic() + timeout):
        _ABANDONED.append((request, keep))
        raise CollectiveTimeout(
            f"the launch's rendezvous ({op}) did not complete within {timeout:g} s: a "
            "rank never arrived; check that every rank calls it, or raise "
            "DISTCACHE_INIT_TIMEOUT", op="rendezvous", timeout=timeout)


def _encode(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise CommError(f"a rendezvous message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}",
                        op="rendezvous")
    return data


def _decode(data: bytes, sender: int) -> Any:
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # "[[[[..." nests deep
        raise CommError(f"rank {sender} sent a malformed rendezvous message: {exc}",
                        op="rendezvous", rank=sender) from exc


def _length(value: int, sender: int) -> int:
    if not 0 <= value <= MAX_MESSAGE_BYTES:
        raise CommError(f"rank {sender} announced a rendezvous message of {value} bytes "
                        f"(at most {MAX_MESSAGE_BYTES})", op="rendezvous", rank=sender)
    return value


def allgather_str(comm: Any, text: str, timeout: float | None = None) -> list[str]:
    """Every rank's ``text``, in rank order, within ``timeout`` seconds (None: no limit).

    Raises:
        CollectiveTimeout: a rank did not arrive in time.
        CommError: a rank sent a malformed message.
    """
    from mpi4py import MPI

    began = time.monotonic()
    mine = _encode(text)
    sent, lengths = array("q", [len(mine)]), array("q", [0] * comm.Get_size())
    _waited(comm.Iallgather([sent, MPI.INT64_T], [lengths, MPI.INT64_T]), (sent, lengths),
            "allgather", timeout)
    counts = [_length(n, rank) for rank, n in enumerate(lengths)]
    displs = [sum(counts[:rank]) for rank in range(len(counts))]
    out = bytearray(sum(counts))
    _waited(comm.Iallgatherv([mine, MPI.BYTE], [out, (counts, displs), MPI.BYTE]),
            (mine, out), "allgather", _left(timeout, began))
    texts = []
    for rank, (start, count) in enumerate(zip(displs, counts, strict=True)):
        value = _decode(bytes(out[start:start + count]), rank)
        if not isinstance(value, str):
            raise CommError(f"rank {rank} sent a {type(value).__name__} where a host name "
                            "belongs", op="rendezvous", rank=rank)
        texts.append(value)
    return texts


def _left(timeout: float | None, began: float) -> float | None:
    """What remains of ``timeout`` (None: no limit) since ``began``, at least nothing."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - began))


def _fitted(message: tuple[str, str, int]) -> bytes:
    """``message`` encoded, its text cut until it fits: rank 0 must reach the
    broadcast whatever it says (a long failure naming every host of a large job), or
    every other rank would wait in it for ever."""
    status, text, port = message
    while True:
        data = json.dumps([status, text, port], separators=(",", ":")).encode()
        if len(data) <= MAX_MESSAGE_BYTES or not text:
            return _encode([status, text, port])
        text = text[: len(text) * 3 // 4 - 16].rstrip() + " [cut]" if len(text) > 64 else ""


def bcast_message(comm: Any, message: tuple[str, str, int] | None,
                  timeout: float | None = None) -> tuple[str, str, int]:
    """Rank 0's ``(status, text, port)`` on every rank (``message`` is read on rank 0),
    within ``timeout`` seconds (None: no limit).

    Raises:
        CollectiveTimeout: a rank did not arrive in time.
        CommError: rank 0's message is malformed.
    """
    from mpi4py import MPI

    began = time.monotonic()
    data = _fitted(message) if comm.Get_rank() == 0 and message is not None else b""
    length = array("q", [len(data)])
    _waited(comm.Ibcast([length, MPI.INT64_T], root=0), length, "broadcast", timeout)
    buffer = bytearray(data) if comm.Get_rank() == 0 else bytearray(_length(length[0], 0))
    _waited(comm.Ibcast([buffer, MPI.BYTE], root=0), buffer, "broadcast",
            _left(timeout, began))
    value = _decode(bytes(buffer), 0)
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], str) and type(value[2]) is int):
        raise CommError("rank 0 sent a rendezvous message of the wrong shape",
                        op="rendezvous", rank=0)
    return value[0], value[1], value[2]

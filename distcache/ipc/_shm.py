"""The host backend: one POSIX shared-memory segment per pool, under ``/dev/shm``.

The segment is created with ``os.open`` + ``mmap`` rather than
``multiprocessing.shared_memory``: on Python <= 3.12 every attach registers the name
with a resource tracker that unlinks it when *any* attaching process exits
(cpython gh-82300; the CUDA IPC research notes, 4.1). Its pages are reserved up front
with ``posix_fallocate``, because a full ``/dev/shm`` (64 MB by default in Docker)
otherwise shows up as SIGBUS on the first write into an unbacked page, not as an
error (research notes, 4.3). The owner unlinks the name right after the exchange
barrier, so a crash after it leaks nothing; mappings outlive the name. A producer
killed before it holds its segment locked, and the next segment made on the host
sweeps such names away (:mod:`distcache.ipc._stale`).
"""

from __future__ import annotations

import mmap
import os
import stat
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from distcache._log import get_logger
from distcache.errors import IpcError, PoolError
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._layout import Layout, WordArray, in_process
from distcache.ipc._producer import DEFAULT_SLOTS, ProducerPool
from distcache.ipc._stale import NAME_RE, hold, release, sweep_stale

log = get_logger(__name__)

SHM_DIR = "/dev/shm"
_NAME_RE = NAME_RE


def _unmap(mm: mmap.mmap, what: str) -> None:
    try:
        mm.close()
    except BufferError:
        # Views handed out are still alive; unmapping now would leave them pointing at
        # nothing. The mapping goes away with the last of them.
        log.warning("%s: tensors still view the segment; it is unmapped when they are freed", what)


def create_segment(path: str, size: int, pool_id: str) -> tuple[mmap.mmap, int]:
    """Create, reserve and map a new zeroed segment of ``size`` bytes at ``path``, after
    sweeping stale names away; the mapping and the descriptor that holds the segment
    locked until :func:`~distcache.ipc._stale.release` unlinks it.

    Raises:
        PoolError: ``/dev/shm`` has too little free space, or creating it failed.
    """
    try:
        vfs = os.statvfs(SHM_DIR)
    except OSError as exc:
        raise PoolError(f"cannot use {SHM_DIR}: {exc}", path=SHM_DIR) from exc
    if sweep_stale(SHM_DIR):
        vfs = os.statvfs(SHM_DIR)
    free = vfs.f_bavail * vfs.f_frsize
    if size > free:
        raise PoolError(
            f"IPC pool {pool_id} needs {size} bytes of {SHM_DIR} but only {free} are "
            "free; use a smaller pool or give the container more shared memory "
            "(docker --shm-size, or an emptyDir with medium: Memory)",
            path=SHM_DIR,
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PoolError(f"cannot create {path}: {exc}", path=path) from exc
    try:
        hold(fd, path)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise PoolError(
                f"cannot reserve {size} bytes for IPC pool {pool_id} in {SHM_DIR}: "
                f"{exc}; free space or enlarge {SHM_DIR}",
                path=path,
            ) from exc
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), fd
    except BaseException:
        release(path, fd)
        raise


def open_segment(name: str, size: int, descriptor: PoolDescriptor) -> mmap.mmap:
    """Map the existing segment ``name`` of a peer's pool, which must be ``size`` bytes.

    Raises:
        IpcError: the name is not a distcache segment, it cannot be opened, or its
            size differs (a forged descriptor must not make us map past its end,
            where an access would be SIGBUS rather than an error).
    """
    if not _NAME_RE.match(name):
        raise IpcError(
            f"pool {descriptor.pool_id}: {name!r} is not a distcache segment name",
            pool_id=descriptor.pool_id,
        )
    expected = segment_name(descriptor.pool_id, descriptor.epoch)
    if name != expected:
        raise IpcError(
            f"pool {descriptor.pool_id} epoch {descriptor.epoch}: handle names segment "
            f"{name!r}, not its own {expected!r}",
            pool_id=descriptor.pool_id,
        )
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise IpcError(
            f"cannot open segment {path} of pool {descriptor.pool_id} (owner "
            f"{_owner(descriptor)}): {exc}; the owner unlinks it once every consumer "
            "mapped it, so a pool must be mapped during PoolRegistry.exchange, or "
            "added before its producer's consumers all joined",
            pool_id=descriptor.pool_id,
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise IpcError(
                f"segment {path} of pool {descriptor.pool_id} is not a regular file owned by "
                f"this user (mode {st.st_mode:o}, owned by uid {st.st_uid}, not {os.geteuid()})",
                pool_id=descriptor.pool_id,
            )
        found = st.st_size
        if found != size:
            raise IpcError(
                f"segment {path} is {found} bytes, descriptor says {size}",
                pool_id=descriptor.pool_id,
            )
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def segment_name(pool_id: str, epoch: int) -> str:
    """The ``/dev/shm`` name of the segment of pool ``pool_id`` at ``epoch``."""
    return f"distcache.{pool_id}.{epoch:x}"


def _owner(descriptor: PoolDescriptor) -> str:
    return "outside the group" if descriptor.owner is None else f"rank {descriptor.owner}"


class _Memory:
    """A mapped segment and the torch view over it (created on first use)."""

    def __init__(self, mm: mmap.mmap, data_start: int, stride: int) -> None:
        self.mm = mm
        self.words = WordArray(memoryview(mm)[:data_start], stride)
        self._base: Any = None

    def base(self) -> Any:
        if self._base is None:
            import torch

            # Through a memoryview: torch.frombuffer(mmap) keeps no buffer export, so
            # mmap.close() would succeed under live views and leave them dangling
            # (SIGSEGV on the next read). The memoryview's export makes close() raise
            # BufferError while any view is alive, and _unmap defers the unmap.
            self._base = torch.frombuffer(memoryview(self.mm), dtype=torch.uint8)
        return self._base

    def close(self, what: str) -> None:
        self.words.release()
        self._base = None
        _unmap(self.mm, what)


class ShmPool(ProducerPool):
    """A producer pool in POSIX shared memory; ``put`` takes CPU tensors.

    ``consumers`` are the ranks that read (and ack) this pool; by default every other
    rank on this node, fixed at :meth:`PoolRegistry.exchange`.

    Raises:
        PoolError: ``/dev/shm`` has too little free space, or reserving it failed.
        IpcError: a bad argument.
    """

    backend = "shm"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        consumers: Sequence[int] | None = None,
        name: str | None = None,
        slots: int = DEFAULT_SLOTS,
    ) -> None:
        super().__init__(capacity_bytes, consumers=consumers, name=name, slots=slots, device=-1)
        self.segment = segment_name(self.pool_id, self.epoch)
        self.path = os.path.join(SHM_DIR, self.segment)
        mm, self._held = create_segment(self.path, self.data_start + self.capacity,
                                        self.pool_id)
        self._mem = _Memory(mm, self.data_start, self.layout.stride)
        self._linked = True
        self._finalizer = weakref.finalize(self, in_process, os.getpid(), release,
                                           self.path, self._held)
        self._start(self._mem.words)

    def _handle(self) -> bytes:
        return self.segment.encode()

    def _check_tensor(self, tensor: Any) -> None:
        if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
            raise IpcError(
                f"ShmPool.put needs a CPU tensor, got one on {getattr(tensor, 'device', '?')}",
                pool_id=self.pool_id,
            )

    def _write(self, offset: int, tensor: Any) -> None:
        import torch

        flat = tensor.reshape(-1).view(torch.uint8)
        self._mem.base()[offset : offset + flat.numel()].copy_(flat)

    def unlink(self) -> None:
        """Remove the segment's name from ``/dev/shm`` (idempotent); mappings survive."""
        if self._linked:
            self._linked = False
            release(self.path, self._held)
            self._finalizer.detach()

    def _free(self) -> None:
        self.unlink()
        self._mem.close(f"IPC pool {self.pool_id}")


class ShmMapping:
    """A consumer's one mapping of a peer's :class:`ShmPool`.

    Everything is host memory: the producer wrote the ready word before the ref left
    it, so readiness is checked on the host, and an ack is one store, made after the
    reads it follows (``stream`` arguments are accepted and unused).
    """

    #: The device consumers' tensors live on (None: host memory).
    device = None
    #: The ready word is final by the time a ref arrives: check it on the host.
    host_ready = True

    def __init__(self, descriptor: PoolDescriptor) -> None:
        if descriptor.backend != "shm":
            raise IpcError(
                f"pool {descriptor.pool_id} is a {descriptor.backend} pool, not shm",
                pool_id=descriptor.pool_id,
            )
        self.descriptor = descriptor
        name = descriptor.handle.decode("ascii", "replace")
        mm = open_segment(name, descriptor.segment_bytes, descriptor)
        stride = Layout(descriptor.slots, descriptor.ack_words).stride
        self._mem = _Memory(mm, descriptor.data_start, stride)
        self.words = self._mem.words

    def view(self, offset: int, nbytes: int) -> Any:
        """uint8 tensor over ``[offset, offset + nbytes)`` of the segment (zero-copy)."""
        return self._mem.base()[offset : offset + nbytes]

    def order_ready(self, index: int, generation: int, stream: Any) -> None:
        """Nothing to order: the host already saw the ready word."""

    def write_ack(self, index: int, generation: int, stream: Any) -> None:
        self.words.set(index, generation)

    def settle(self) -> None:
        """Nothing is in flight on host memory."""

    def close(self, leave: Callable[[], None] | None = None) -> None:
        """Mark this consumer gone (``leave``), then unmap (deferred while views live:
        host memory outlives the producer's unmap, so nothing can be freed under them)."""
        if leave is not None:
            leave()
        self._mem.close(f"mapping of pool {self.descriptor.pool_id}")

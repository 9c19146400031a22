"""What a malformed or misplaced pool descriptor is called in its error.

Every descriptor error called itself an invalid feature reference, and a rank sending
another rank's descriptor was reported as a pool claimed twice by the same rank
("claimed by ranks 1 and 1"). A pool id claimed by two ranks keeps its message (the
guard).
"""

from __future__ import annotations

import pytest

from distcache.errors import IpcError
from distcache.ipc import PoolDescriptor, ShmPool
from distcache.ipc._descriptor import gathered_descriptors

pytest.importorskip("torch")


@pytest.mark.parametrize("blob", [b"garbage-not-a-descriptor", b"DCP\x03\x00\x01p"])
def test_a_malformed_descriptor_is_called_one(blob: bytes) -> None:
    with pytest.raises(IpcError, match=r"^invalid pool descriptor: ") as caught:
        PoolDescriptor.unpack(blob)
    assert "feature reference" not in str(caught.value)


def _descriptor(name: str, owner: int) -> bytes:
    pool = ShmPool(1 << 12, name=name, slots=4)
    try:
        pool.bind(owner=owner, consumers=[1 - owner])
        return pool.descriptor().pack()
    finally:
        pool.close()


def test_a_rank_sending_another_ranks_pool_is_named_as_such() -> None:
    theirs = _descriptor("sentbyother", owner=0)
    with pytest.raises(IpcError, match="rank 1 sent pool sentbyother of rank 0"):
        gathered_descriptors([[], [theirs]])


def test_a_pool_id_claimed_twice_keeps_its_message() -> None:
    first, second = _descriptor("twice", owner=0), _descriptor("twice", owner=1)
    with pytest.raises(IpcError, match="claimed by ranks 0 and 1"):
        gathered_descriptors([[first], [second]])

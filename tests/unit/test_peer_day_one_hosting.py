"""Where a node agent listens: its Unix socket fits the kernel's limit in bytes (a pool
path of non-ASCII characters, short in characters, moves it to a private directory), and
its TCP address is the local end of the route to ``MASTER_ADDR``, IPv6 included; a
``MASTER_ADDR`` that gives no route is named."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from distcache.peer import derive_key, host_agent, job_address
from distcache.peer._hosting import _MAX_SOCKET_PATH, leave, socket_path
from distcache.store import ArtifactPool

#: Three bytes each in UTF-8: a path of them is three times longer in bytes.
WIDE = "共有キャッシュ"


def test_a_pool_path_short_in_characters_but_long_in_bytes_gets_a_private_socket_dir(
) -> None:
    root = Path(WIDE * 6)  # 42 characters, 126 bytes
    path = socket_path(root, "node0")
    try:
        assert len(str(root / path.name)) <= _MAX_SOCKET_PATH < len(os.fsencode(root))
        assert path.parent != root
        assert len(os.fsencode(path)) <= _MAX_SOCKET_PATH
    finally:
        if path.parent != root:
            path.parent.rmdir()


def test_a_pool_path_that_fits_in_bytes_keeps_the_socket() -> None:
    root = Path(WIDE)
    assert socket_path(root, "node0").parent == root


def test_an_agent_on_such_a_pool_starts_and_leaves_nothing_behind() -> None:
    # Under /tmp, so that the pool's path is short in characters wherever tests run.
    base = Path(tempfile.mkdtemp(prefix="dc-", dir="/tmp"))
    try:
        root = base / (WIDE * 5) / "pool"
        assert len(str(root)) + 24 <= _MAX_SOCKET_PATH < len(os.fsencode(root))
        agent = host_agent(ArtifactPool(root), lambda: None, derive_key(b"s" * 32), "node0")
        try:
            assert agent.socket_path is not None and agent.local_endpoint
            made = agent.socket_path.parent
            assert made != root and agent.socket_path.exists()
        finally:
            leave(agent)
        assert not made.exists()  # the private directory went with the agent
    finally:
        shutil.rmtree(base)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("master", ["::1", "[::1]"])
def test_an_ipv6_master_addr_gives_the_ipv6_route(master: str) -> None:
    assert job_address({"MASTER_ADDR": master}) == "::1"


def test_an_ipv4_master_addr_gives_the_ipv4_route() -> None:
    assert job_address({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"


def test_a_master_addr_that_does_not_resolve_is_named_at_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    bad = "no-such-host.invalid"
    real_getaddrinfo, real_gethostbyname = socket.getaddrinfo, socket.gethostbyname

    def refuse(name: object) -> None:
        if name == bad:  # no resolver is asked for it
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        refuse(host)
        return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    def gethostbyname(host: str) -> str:
        refuse(host)
        return real_gethostbyname(host)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyname", gethostbyname)
    caplog.set_level(logging.WARNING)
    address = job_address({"MASTER_ADDR": bad})
    assert address  # the host name's address, else loopback
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and f"MASTER_ADDR={bad}" in said[0]

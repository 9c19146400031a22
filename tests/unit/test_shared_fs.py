"""A pool shared by several users, some of them hostile; and a token nobody may see.

The pool is a group-writable, set-gid directory used with ``umask 002`` by processes
of two unprivileged users in one group. It must work for both (one publishes, the
other reads and publishes more), and anyone who can write into it must still be
unable to get bytes served that do not match their name, or to steer a read or a
write outside the pool with a symlink planted in ``objects/``, ``objects/<xx>/``,
``tmp/`` or ``locks/``. Temporary files are private (``0600``) while written and
created exclusively.

The users are numeric ids with no password entry (nothing on the machine is
changed). They run in forked children that drop privileges with ``setgid``/``setuid``
and never ``exec``, because the interpreter may live where those ids cannot reach;
each child has its own session and is killed as a group when it overruns.

The bearer token (``DISTCACHE_ORIGIN_TOKEN``) is checked last: it must not appear in
logs (at DEBUG), exception messages, reprs or ``describe()``, on any path.
"""

from __future__ import annotations

import codecs
import contextlib
import grp
import io
import json
import logging
import os
import pickle
import pwd
import select
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import prefetch, sync
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import (
    CollectiveTimeout,
    CommError,
    ConfigError,
    DistcacheError,
    IntegrityError,
    OriginError,
    PoolError,
    PrefetchError,
)
from distcache.origins import DirOrigin, HttpOrigin, OriginChain, open_origin
from distcache.store._identity import PoolIdentity
from distcache.store._pool import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.unit.test_comm_local import run_ranks

CHILD_TIMEOUT = 60.0

# Children drop root and may then be unable to read the interpreter's library: load
# the codecs they use (the pool reads /proc/self/status as ASCII) while they still can.
for _codec in ("ascii", "utf-8", "latin-1"):
    codecs.lookup(_codec)

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="switching between users needs root (setuid/setgid)",
)


def _unused_ids(start: int) -> tuple[int, int, int]:
    """A group id and two user ids that name nobody on this machine."""
    n = start
    while True:
        try:
            grp.getgrgid(n)
        except KeyError:
            try:
                pwd.getpwuid(n + 1)
                pwd.getpwuid(n + 2)
            except KeyError:
                if all(_free_uid(u) for u in (n + 1, n + 2)):
                    return n, n + 1, n + 2
        n += 10


def _free_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


class Users:
    """Two unprivileged users in one group, and a way to run code as each."""

    def __init__(self) -> None:
        self.gid, self.a, self.b = _unused_ids(47100)

    def run(self, uid: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a forked child running as ``uid`` (group ``gid``, umask 002).

        Returns what ``fn`` returned; re-raises its failure as an AssertionError that
        carries the child's message.
        """
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process; the child only
            # runs library code that was imported before the fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            payload: tuple[str, Any]
            try:
                os.close(read_end)
                os.setsid()
                os.setgroups([self.gid])
                os.setgid(self.gid)
                os.setuid(uid)
                os.umask(0o002)
                payload = ("ok", fn(*args))
            except BaseException as exc:
                payload = ("error", f"{type(exc).__name__}: {exc}")
            try:
                data = pickle.dumps(payload)
                while data:
                    data = data[os.write(write_end, data):]
            finally:
                os._exit(0)
        os.close(write_end)
        chunks = []
        deadline = time.monotonic() + CHILD_TIMEOUT
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([read_end], [], [], left)[0]:
                    raise AssertionError(f"child as uid {uid} overran {CHILD_TIMEOUT}s")
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(read_end)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        status, value = pickle.loads(b"".join(chunks))
        if status != "ok":
            raise AssertionError(f"as uid {uid}: {value}")
        return value


class Shared:
    """A sandbox: a set-gid team pool, and an ``outside`` full of writable bait."""

    def __init__(self, users: Users) -> None:
        self.users = users
        self.top = Path(tempfile.mkdtemp(prefix="distcache-shared-"))
        os.chmod(self.top, 0o755)
        self.root = self.top / "pool"
        self.root.mkdir()
        os.chown(self.root, 0, users.gid)
        os.chmod(self.root, 0o2775)
        self.outside = self.top / "outside"
        self.outside.mkdir()
        os.chmod(self.outside, 0o777)  # a followed symlink would really land here
        for name in ("sentinel", "lock-target", "tmp-target"):
            (self.outside / name).write_bytes(b"sentinel\n")
            os.chmod(self.outside / name, 0o666)

    def snapshot_outside(self) -> dict[str, tuple[int, bytes]]:
        out = {}
        for path in sorted(self.top.rglob("*")):
            if path == self.root or self.root in path.parents:
                continue
            st = path.lstat()
            body = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[str(path.relative_to(self.top))] = (st.st_mode, body)
        return out

    def close(self) -> None:
        shutil.rmtree(self.top, ignore_errors=True)


@pytest.fixture
def shared() -> Iterator[Shared]:
    s = Shared(Users())
    yield s
    s.close()


class BytesOrigin:
    """Serves fixed bytes; ``pause`` runs after the first half is written."""

    def __init__(self, data: bytes, pause: Callable[[], None] | None = None) -> None:
        self.data = data
        self.pause = pause

    def describe(self) -> str:
        return "bytes:test"

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        half = len(self.data) // 2
        out.write(self.data[:half])
        out.flush()
        if self.pause is not None:
            self.pause()
        out.write(self.data[half:])
        return len(self.data)


def _blob(tag: str, avoid_prefixes: frozenset[str] | set[str] = frozenset()) -> tuple[bytes, str]:
    """Bytes whose sha's fan-out prefix is not in ``avoid_prefixes``."""
    for i in range(10_000):
        data = f"{tag}-{i}\n".encode() * 64
        sha = sha256_hex(data)
        if sha[:2] not in avoid_prefixes:
            return data, sha
    raise AssertionError("no blob with a fresh prefix")


def _obj(root: Path, sha: str) -> Path:
    return root / "objects" / sha[:2] / sha


# -- a pool shared by two users --------------------------------------------------------


@needs_root
def test_two_users_in_one_group_share_a_setgid_pool(shared: Shared) -> None:
    users, root = shared.users, shared.root
    x, sx = _blob("x")
    y, sy = _blob("y")
    z, sz = _blob("z")

    def first() -> str:
        pool = ArtifactPool(root)
        pool.put(x, sx)
        pool.remember([Artifact("team/x.cubin", sx)])
        return pool.pool_id

    def second() -> tuple[str, bool, dict[str, str]]:
        pool = ArtifactPool(root)
        got = pool.get(sx) == x
        pool.put(y)
        pool.fetch(Artifact("team/z.cubin", sz, len(z)), BytesOrigin(z))
        pool.remember([Artifact("team/y.cubin", sy)])
        return pool.pool_id, got, pool.names()

    def third() -> tuple[bytes | None, bytes | None, dict[str, str], int]:
        pool = ArtifactPool(root)
        return pool.get(sy), pool.get(sz), pool.names(), pool.quarantined

    pool_id = users.run(users.a, first)
    pool_id_b, b_read_x, names_b = users.run(users.b, second)
    y_for_a, z_for_a, names_a, quarantined = users.run(users.a, third)
    assert pool_id_b == pool_id
    assert b_read_x and y_for_a == y and z_for_a == z and quarantined == 0
    expected = {"team/x.cubin": sx, "team/y.cubin": sy, "team/z.cubin": sz}
    assert names_a == names_b == expected
    owners = set()
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        assert st.st_gid == users.gid, f"{path} is not in the team group"
        if stat.S_ISDIR(st.st_mode):
            assert st.st_mode & stat.S_ISGID, f"{path} lost the set-gid bit"
            assert stat.S_IMODE(st.st_mode) & 0o070 == 0o070, f"{path} not group-writable"
        elif path.parent.parent.name == "objects":
            assert stat.S_IMODE(st.st_mode) == 0o444, f"object {path} is writable"
            owners.add(st.st_uid)
        elif path.name in ("names.log", "journal.log"):
            assert stat.S_IMODE(st.st_mode) & 0o060 == 0o060, f"{path} not group-writable"
    assert owners == {users.a, users.b}


# -- planted objects are never served --------------------------------------------------


@needs_root
def test_an_object_whose_bytes_do_not_match_its_name_is_quarantined_never_served(
    shared: Shared,
) -> None:
    users, root = shared.users, shared.root
    x, sx = _blob("x")
    _w, sw = _blob("w")

    def publish() -> None:
        ArtifactPool(root).put(x)

    def plant() -> None:
        ArtifactPool(root)  # makes the layout, as any user may
        # The group may write the fan-out directory: replace the other user's object
        # and invent one nobody published.
        os.unlink(_obj(root, sx))
        _obj(root, sx).write_bytes(b"evil bytes claiming to be x")
        os.makedirs(_obj(root, sw).parent, exist_ok=True)
        _obj(root, sw).write_bytes(b"evil bytes claiming to be w")

    def read() -> tuple[bytes | None, bytes | None, int, int, bytes]:
        pool = ArtifactPool(root)
        got_x, got_w = pool.get(sx), pool.get(sw)
        quarantined = len(os.listdir(root / "quarantine"))
        repaired = pool.fetch(Artifact("x.cubin", sx, len(x)), BytesOrigin(x))
        return got_x, got_w, pool.quarantined, quarantined, repaired

    users.run(users.a, publish)
    users.run(users.b, plant)
    got_x, got_w, counted, in_quarantine, repaired = users.run(users.a, read)
    assert (got_x, got_w) == (None, None)
    assert counted == 2 and in_quarantine == 2
    assert repaired == x and _obj(root, sx).read_bytes() == x


# -- planted symlinks are never followed -----------------------------------------------


@needs_root
def test_symlinks_planted_in_objects_tmp_and_locks_are_never_followed(
    shared: Shared,
) -> None:
    users, root, outside = shared.users, shared.root, shared.outside
    x, sx = _blob("x")
    p, sp = _blob("p", {sx[:2]})
    q, sq = _blob("q", {sx[:2], sp[:2]})
    r, sr = _blob("r", {sx[:2], sp[:2], sq[:2]})
    # Bait with the right bytes: following a link would even pass verification.
    (outside / sp).write_bytes(p)
    (outside / "fanout").mkdir()
    (outside / "fanout" / sq).write_bytes(q)
    os.chmod(outside / "fanout", 0o777)

    def publish() -> None:
        ArtifactPool(root).put(x)

    def plant() -> None:
        ArtifactPool(root)
        os.makedirs(_obj(root, sp).parent, exist_ok=True)
        os.symlink(outside / sp, _obj(root, sp))  # objects/xx/<sha> -> outside file
        os.symlink(outside / "fanout", root / "objects" / sq[:2])  # objects/<xx> -> outside
        os.symlink(outside / "lock-target", root / "locks" / f"{sr}.lock")
        os.symlink(outside / "tmp-target", root / "tmp" / "planted.tmp")
        old = time.time() - 7200  # old enough for the sweep
        os.utime(root / "tmp" / "planted.tmp", (old, old), follow_symlinks=False)

    def victim() -> dict[str, Any]:
        pool = ArtifactPool(root)  # opening sweeps tmp/
        seen: dict[str, Any] = {
            "get_p": pool.get(sp), "get_q": pool.get(sq), "has_q": pool.has(sq),
        }
        pool.put(p)
        seen["p_is_file"] = stat.S_ISREG(os.lstat(_obj(root, sp)).st_mode)
        try:
            pool.put(q)
            seen["put_q"] = "published"
            seen["q_dir_is_real"] = stat.S_ISDIR(os.lstat(root / "objects" / sq[:2]).st_mode)
        except PoolError:
            seen["put_q"] = "refused"
        seen["fetch_r"] = pool.fetch(Artifact("r.cubin", sr, len(r)), BytesOrigin(r)) == r
        seen["tmp_left"] = sorted(os.listdir(root / "tmp"))
        return seen

    users.run(users.a, publish)
    users.run(users.b, plant)
    before = shared.snapshot_outside()
    seen = users.run(users.a, victim)
    assert shared.snapshot_outside() == before, "something outside the pool changed"
    assert seen["get_p"] is None and seen["get_q"] is None and not seen["has_q"]
    assert seen["p_is_file"]  # the planted link was quarantined, a real object replaced it
    # The planted objects/<xx> link was moved aside; q went into a real directory.
    assert seen["put_q"] == "published" and seen["q_dir_is_real"]
    assert seen["fetch_r"]
    assert seen["tmp_left"] == []  # the planted tmp/ link was swept, its target kept
    assert not (outside / "fanout" / sp).exists() and sorted(
        os.listdir(outside / "fanout")) == [sq]


@needs_root
def test_a_pool_whose_tmp_or_locks_is_a_symlink_is_refused_before_any_write(
    shared: Shared,
) -> None:
    users, root, outside = shared.users, shared.root, shared.outside
    for sub in ("objects", "quarantine"):
        (root / sub).mkdir()
        os.chown(root / sub, users.a, users.gid)
    (root / "format").write_text("1\n")  # a pool's, not another tool's directory
    os.chown(root / "format", users.a, users.gid)
    os.symlink(outside, root / "tmp")
    os.symlink(outside, root / "locks")
    before = shared.snapshot_outside()

    def open_pool() -> str:
        try:
            ArtifactPool(root).put(b"x")
        except PoolError as exc:
            return str(exc)
        return "opened"

    assert "not a directory" in users.run(users.a, open_pool)
    assert shared.snapshot_outside() == before


# -- temporary files -------------------------------------------------------------------


@needs_root
def test_temporary_files_are_private_while_being_written(shared: Shared) -> None:
    users, root = shared.users, shared.root
    data, sha = _blob("t")

    def download() -> list[tuple[str, int, int, bool]]:
        pool = ArtifactPool(root)
        seen: list[tuple[str, int, int, bool]] = []

        def inspect() -> None:
            for entry in os.scandir(root / "tmp"):
                st = entry.stat(follow_symlinks=False)
                seen.append((entry.name, stat.S_IMODE(st.st_mode), st.st_uid,
                             stat.S_ISREG(st.st_mode)))

        pool.fetch(Artifact("t.cubin", sha, len(data)), BytesOrigin(data, inspect))
        return seen

    seen = users.run(users.a, download)
    assert len(seen) == 1
    name, mode, uid, regular = seen[0]
    assert regular and uid == users.a
    assert mode == 0o600, f"temporary file {name} was {oct(mode)} while written"
    assert os.listdir(root / "tmp") == []


def test_temporary_files_are_created_exclusively_never_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    target = tmp_path / "target"
    target.write_bytes(b"sentinel\n")
    data, sha = _blob("e")
    names: list[str] = []

    def note() -> None:
        names.extend(os.listdir(pool.root / "tmp"))

    # Make the temporary name predictable, as an attacker would have to guess it.
    monkeypatch.setattr("distcache.store.layout._token", lambda n: "0" * (2 * n))
    pool.fetch(Artifact("e.cubin", sha, len(data)), BytesOrigin(data, note))
    assert len(names) == 1
    os.unlink(_obj(pool.root, sha))
    os.symlink(target, pool.root / "tmp" / names[0])
    with pytest.raises(PoolError, match="temporary file"):
        pool.put(data)
    assert target.read_bytes() == b"sentinel\n"
    assert (pool.root / "tmp" / names[0]).is_symlink()


# -- a shared mirror directory ---------------------------------------------------------


def test_a_fifo_planted_in_a_mirror_is_refused_without_hanging(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    os.mkfifo(mirror / "k.cubin")
    outcome: list[BaseException | bytes] = []

    def fetch() -> None:
        try:
            outcome.append(DirOrigin(mirror).fetch(Artifact("k.cubin", sha256_hex(b""))))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # the old open() blocked until a writer came; be that writer
        with open(os.open(mirror / "k.cubin", os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        worker.join(10)
        pytest.fail("opening a FIFO in the mirror blocked")
    assert isinstance(outcome[0], OriginError) and "not a regular file" in str(outcome[0])


def test_a_mirror_file_larger_than_declared_is_not_read_to_its_end(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    with open(mirror / "k.cubin", "wb") as huge:
        huge.truncate(64 << 20)  # sparse: costs no disk, would cost 64 MiB of reading
    out = io.BytesIO()
    with pytest.raises(IntegrityError, match="size over 4096"):
        DirOrigin(mirror).fetch_into(Artifact("k.cubin", sha256_hex(b"\0" * 4096), 4096), out)
    assert len(out.getvalue()) <= 4096


# -- the bearer token ------------------------------------------------------------------

TOKEN = "tok-s3cr3t-0123456789abcdef"


def _texts(exc: BaseException) -> Iterator[str]:
    """Everything an error shows: message, repr, attributes, and its causes."""
    seen: BaseException | None = exc
    while seen is not None:
        yield str(seen)
        yield repr(seen)
        yield repr(getattr(seen, "__dict__", {}))
        yield repr(pickle.loads(pickle.dumps(seen))) if isinstance(seen, DistcacheError) else ""
        seen = seen.__cause__ or seen.__context__


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_bearer_token_never_appears_in_logs_errors_or_reprs(
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKEN", TOKEN + "\n")  # as `$(cat file)` leaves it
    good = artifacts[0]
    texts: list[str] = []

    def attempt(origin: HttpOrigin, artifact: Artifact = good) -> None:
        texts.extend([origin.describe(), repr(origin)])
        try:
            origin.fetch(artifact)
        except (OriginError, IntegrityError) as exc:
            texts.extend(_texts(exc))

    opened: list[HttpOrigin] = []

    def make(**kwargs: Any) -> HttpOrigin:
        opened.append(HttpOrigin(origin_server.url, token=TOKEN + "\n", retries=1, timeout=5,
                                 sleep=lambda _s: None, **kwargs))
        return opened[-1]

    attempt(make())
    assert origin_server.last_headers["authorization"] == f"Bearer {TOKEN}"
    for fault in ("500", "429", "404", "truncate", "wrong_bytes"):
        origin_server.inject(fault, count=None)
        attempt(make())
        origin_server.reset()
    with LoopbackOrigin(artifact_dir) as other:
        elsewhere = other.url.replace("127.0.0.1", "localhost")
        origin_server.inject("redirect", base=elsewhere, count=None)
        attempt(make())  # refused: another host
        attempt(make(allow_redirect_hosts=["localhost"]))  # followed, without the token
        assert "authorization" not in other.last_headers
        origin_server.reset()
    origin_server.inject("redirect", location=f"ftp://127.0.0.1/{TOKEN[:3]}", count=None)
    attempt(make())
    origin_server.reset()
    unreachable = HttpOrigin(f"http://127.0.0.1:{_closed_port()}", retries=1, timeout=2,
                             sleep=lambda _s: None)
    opened.append(unreachable)
    attempt(unreachable)
    attempt(make(), Artifact("nowhere/x.cubin", good.sha256))
    chain = OriginChain([make(), unreachable])
    texts.append(chain.describe())
    try:
        chain.fetch(Artifact("nowhere/y.cubin", good.sha256))
    except OriginError as exc:
        texts.extend(_texts(exc))
    pool = ArtifactPool(tmp_path / "pool")
    try:
        pool.fetch(Artifact("nowhere/z.cubin", good.sha256), make())
    except OriginError as exc:
        texts.extend(_texts(exc))
    for origin in opened:
        origin.close()
    everything = "\n".join([*texts, caplog.text, *(r.getMessage() for r in caplog.records)])
    assert "GET" in everything and "refused redirect" in everything  # the paths ran
    assert TOKEN not in everything
    assert TOKEN[4:16] not in everything


@pytest.mark.parametrize("token", ["s3cr3t\x7fb", "s3cr3t\nx", "s3cr3t\u00e9", "\x1b[31ms3cr3t"])
def test_an_unusable_token_is_a_config_error_that_does_not_quote_it(
    monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    # A token with a control character used to fail inside requests, whose error
    # (then ours, then the logs) quoted the whole header value.
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKEN", token)
    monkeypatch.setenv("DISTCACHE_ORIGIN", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as info:
        open_origin("http://127.0.0.1:9")
    shown = "\n".join(_texts(info.value))
    assert "s3cr3t" not in shown


def test_a_token_rejected_by_the_http_stack_is_not_quoted_in_the_error(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    # A caller-supplied Authorization header with a newline: requests refuses it and
    # quotes the value in its exception; ours must not.
    secret = "Bearer hidden-credential\n"
    with HttpOrigin(origin_server.url, retries=0, headers={"Authorization": secret}) as origin, \
            pytest.raises(OriginError) as info:
        origin.fetch(artifacts[0])
    assert "hidden-credential" not in "\n".join(_texts(info.value))


# -- copies of one pool: equal ids, different directories ---------------------------
#
# Thread-ranks with real pools: a "node" is a directory. A copy made with copytree
# keeps its template's pool_id, as a container image or an rsync'd disk does.


class CountingOrigin:
    """Serves artifacts from a directory and counts every request."""

    def __init__(self, root: Path) -> None:
        self.inner = DirOrigin(root)
        self.requests = 0
        self.lock = threading.Lock()

    def describe(self) -> str:
        return self.inner.describe()

    def fetch(self, artifact: Artifact) -> bytes:
        with self.lock:
            self.requests += 1
        return self.inner.fetch(artifact)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        with self.lock:
            self.requests += 1
        return self.inner.fetch_into(artifact, out)


class Copies:
    """A template pool holding the first artifact, and directories made from it."""

    def __init__(self, root: Path, count: int = 4) -> None:
        self.root = root
        self.mirror = root / "mirror"
        self.artifacts = make_artifacts(self.mirror, count, min_size=500, max_size=5000, seed=3)
        self.origin = CountingOrigin(self.mirror)
        template = ArtifactPool(root / "template")
        first = self.artifacts[0]
        template.put((self.mirror / first.name).read_bytes(), first.sha256)
        template.remember([first])
        self.template_id = template.pool_id

    def copy(self, name: str) -> Path:
        target = self.root / name
        if not target.exists():
            shutil.copytree(self.root / "template", target, symlinks=True)
        return target

    def complete(self, root: Path) -> bool:
        pool = ArtifactPool(root)
        return (sorted(pool.objects()) == sorted(a.sha256 for a in self.artifacts)
                and pool.names() == {a.name: a.sha256 for a in self.artifacts})


def _probe_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tmp").glob("probe.*"))


def _events(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in records if r["event"] == event]


def _prefetch_all(copies: Copies, group: ThreadGroup, roots: list[Path],
                  **kwargs: Any) -> list[Any]:
    def body(comm: Communicator) -> Any:
        pool = ArtifactPool(roots[comm.rank])
        return pool, prefetch(copies.artifacts, comm=comm, pool=pool, origin=copies.origin,
                              **kwargs)

    return run_ranks(group, body)


def _ok(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_copies_of_one_pool_are_told_apart_filled_and_renamed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(events))
    copies = Copies(tmp_path)
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    roots = [copies.copy(f"node-{n}") for n in nodes]
    group = ThreadGroup(8, nodes, timeout=20)

    results = _ok(_prefetch_all(copies, group, roots))

    reports = [report for _, report in results]
    assert all(r.pools == 4 for r in reports), reports[0]
    assert reports[0].writers == (0, 2, 4, 6)
    # Each missing artifact came from the origin once, and crossed to the other copies.
    assert copies.origin.requests == 3
    for n in "abcd":
        assert copies.complete(tmp_path / f"node-{n}"), n
        assert _probe_files(tmp_path / f"node-{n}") == []
    # The copy that showed the first probe kept the id; every other took a fresh one,
    # and every rank on it knows the new id.
    ids = [pool.pool_id for pool, _ in results]
    assert ids[0] == ids[1] == copies.template_id
    assert len(set(ids)) == 4 and ids[2] == ids[3] and ids[4] == ids[5] and ids[6] == ids[7]
    assert [ArtifactPool(tmp_path / f"node-{n}").pool_id for n in "abcd"] == ids[::2]
    assert len(_events(events, "pool.renewed")) == 3

    # The next run: distinct ids, so one probe per pool and nothing from the origin.
    copies.origin.requests = 0
    events.unlink()
    again = _ok(_prefetch_all(copies, ThreadGroup(8, nodes, timeout=20), roots))
    assert copies.origin.requests == 0
    assert all(report.pools == 4 and report.downloads == 0 for _, report in again)
    probes = _events(events, "pool.probe")
    assert sorted(p["root"] for p in probes) == sorted(str(r) for r in roots[::2])
    assert _events(events, "pool.renewed") == []


def test_a_copy_shared_by_two_nodes_is_one_pool_with_one_fresh_id(tmp_path: Path) -> None:
    copies = Copies(tmp_path)
    # a: node-local copy; b: another node-local copy; c and d mount one shared copy.
    nodes = ["a", "a", "b", "c", "c", "d", "d"]
    place = {"a": "copy-a", "b": "copy-b", "c": "copy-cd", "d": "copy-cd"}
    roots = [copies.copy(place[n]) for n in nodes]

    results = _ok(_prefetch_all(copies, ThreadGroup(7, nodes, timeout=20), roots))

    report = results[0][1]
    assert report.pools == 3 and report.writers == (0, 2, 3)
    assert copies.origin.requests == 3
    for name in ("copy-a", "copy-b", "copy-cd"):
        assert copies.complete(tmp_path / name), name
        assert _probe_files(tmp_path / name) == []
    ids = [pool.pool_id for pool, _ in results]
    assert ids[0] == ids[1] == copies.template_id
    assert len({ids[2], ids[3], copies.template_id}) == 3
    assert ids[3:] == [ids[3]] * 4
    assert ArtifactPool(tmp_path / "copy-cd").pool_id == ids[3]


def test_a_pool_every_rank_shares_has_one_writer_one_download_each_and_no_probe_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(events))
    copies = Copies(tmp_path)
    shared_root = copies.copy("shared")
    nodes = ["a", "a", "b", "b"]

    results = _ok(_prefetch_all(copies, ThreadGroup(4, nodes, timeout=20), [shared_root] * 4))

    report = results[0][1]
    assert report.pools == 1 and report.writers == (0,)
    assert report.downloads == 3 and copies.origin.requests == 3
    assert report.broadcast_bytes == 0
    assert {pool.pool_id for pool, _ in results} == {copies.template_id}
    assert ArtifactPool(shared_root).pool_id == copies.template_id
    assert copies.complete(shared_root) and _probe_files(shared_root) == []
    assert len(_events(events, "pool.probe")) == 1


def test_pools_with_distinct_ids_are_never_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(events))
    copies = Copies(tmp_path)
    roots = [tmp_path / f"rank{r}" for r in range(3)]
    group = ThreadGroup(3, ["a", "b", "c"], timeout=20)

    results = _ok(_prefetch_all(copies, group, roots))

    assert results[0][1].pools == 3
    assert _events(events, "pool.probe") == []


def test_a_claimant_that_cannot_place_a_probe_is_a_pool_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies = Copies(tmp_path)
    shared_root = copies.copy("shared")
    real = PoolIdentity.probe

    @contextlib.contextmanager
    def refused(self: PoolIdentity, name: str, token: str) -> Iterator[bool]:
        if threading.current_thread().name.endswith("-rank0"):
            yield False  # as on a read-only pool
            return
        with real(self, name, token) as placed:
            yield placed

    monkeypatch.setattr(PoolIdentity, "probe", refused)
    nodes = ["a", "a", "b", "b"]

    def body(comm: Communicator) -> Any:
        threading.current_thread().name = f"t-rank{comm.rank}"
        pool = ArtifactPool(shared_root)
        return pool, prefetch(copies.artifacts, comm=comm, pool=pool, origin=copies.origin)

    results = _ok(run_ranks(ThreadGroup(4, nodes, timeout=20), body))

    # Rank 0 showed nothing: it is alone. Ranks 1 and 2 then probed for their nodes,
    # and all three saw both probes: one pool. Nothing is renamed: no copy was shown.
    assert results[0][1].pools == 2 and results[0][1].writers == (0, 1)
    assert {pool.pool_id for pool, _ in results} == {copies.template_id}
    assert ArtifactPool(shared_root).pool_id == copies.template_id
    assert copies.complete(shared_root) and _probe_files(shared_root) == []


def test_a_failing_probe_round_fails_every_rank_alike_and_leaves_no_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies = Copies(tmp_path)
    nodes = ["a", "b"]
    roots = [copies.copy("copy-a"), copies.copy("copy-b"), copies.copy("copy-b")]

    def broken(self: PoolIdentity) -> str:
        raise RuntimeError("renewal went wrong")

    monkeypatch.setattr(PoolIdentity, "renew", broken)
    results = _prefetch_all(copies, ThreadGroup(3, [*nodes, "b"], timeout=20), roots)

    assert all(isinstance(r, PrefetchError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert {r.phase for r in results} == {"agree"} and {r.rank for r in results} == {1}
    assert "renewal went wrong" in str(results[0])
    assert _probe_files(roots[0]) == [] and _probe_files(roots[1]) == []


def test_a_peer_lost_during_the_probe_round_times_out_and_the_probe_is_removed(
    tmp_path: Path,
) -> None:
    copies = Copies(tmp_path)
    root = copies.copy("shared")
    group = ThreadGroup(2, ["a", "b"], timeout=20)

    during: list[list[str]] = []

    class Vanishing:
        """Rank 1 takes part in the agreement and the probe offer, then is gone."""

        def __init__(self, inner: Communicator) -> None:
            self.inner = inner
            self.gathers = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
            self.gathers += 1
            if self.gathers == 3:  # where it would say which probes it saw
                during.append(_probe_files(root))
                raise CommError("this rank is gone", op="allgather_object")
            return self.inner.allgather_object(obj, timeout=timeout)

    def body(comm: Communicator) -> Any:
        pool = ArtifactPool(root)
        if comm.rank == 1:
            comm = Vanishing(comm)  # type: ignore[assignment]
        return prefetch(copies.artifacts, comm=comm, pool=pool, origin=copies.origin,
                        timeout=2)

    start = time.monotonic()
    results = run_ranks(group, body)

    assert all(isinstance(r, PrefetchError) for r in results), results
    assert isinstance(results[0].__cause__, CollectiveTimeout)
    assert time.monotonic() - start < 30
    assert len(during) == 1 and len(during[0]) == 1  # rank 0's probe, while it waited
    assert _probe_files(root) == []  # and gone once it gave up
    assert copies.origin.requests == 0


def test_sync_tells_copies_apart_and_moves_what_one_of_them_gained(tmp_path: Path) -> None:
    copies = Copies(tmp_path)
    nodes = ["a", "a", "b", "b"]
    roots = [copies.copy(f"copy-{n}") for n in nodes]
    gained = copies.artifacts[1]
    lazy = ArtifactPool(roots[3])  # a lazy download on node b after warm-up
    lazy.put((copies.mirror / gained.name).read_bytes(), gained.sha256)
    lazy.remember([gained])

    def body(comm: Communicator) -> Any:
        pool = ArtifactPool(roots[comm.rank])
        return pool, sync(comm=comm, pool=pool)

    results = _ok(run_ranks(ThreadGroup(4, nodes, timeout=20), body))

    assert results[0][1].pools == 2 and results[0][1].writers == (0, 2)
    for name in ("copy-a", "copy-b"):
        pool = ArtifactPool(tmp_path / name)
        assert gained.sha256 in set(pool.objects()), name
        assert pool.names()[gained.name] == gained.sha256
        assert _probe_files(tmp_path / name) == []
    assert results[0][0].pool_id == copies.template_id != results[2][0].pool_id


def test_two_jobs_probing_one_shared_pool_at_once_never_take_each_other_s_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(events))
    copies = Copies(tmp_path)
    root = copies.copy("shared")
    results: dict[str, list[Any]] = {}

    def job(name: str) -> None:
        results[name] = _prefetch_all(copies, ThreadGroup(3, ["a", "b", "c"], timeout=20),
                                      [root] * 3)

    jobs = [threading.Thread(target=job, args=(n,)) for n in ("one", "two")]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join(60)
    assert not any(t.is_alive() for t in jobs)

    for name in ("one", "two"):
        reports = [report for _, report in _ok(results[name])]
        assert all(r.pools == 1 and r.writers == (0,) for r in reports), name
    assert len(_events(events, "pool.probe")) == 2 and _events(events, "pool.renewed") == []
    assert ArtifactPool(root).pool_id == copies.template_id
    assert copies.complete(root) and _probe_files(root) == []

"""An origin that answers every path with one page (a sign-in page, a portal, a web
application's index, a proxy's notice): the same wrong body for different artifacts.
Each artifact's bytes are checked against its sha256 and a wrong body is retried, so
such an origin would cost every artifact all of its attempts (320 requests and a
minute for 64 artifacts, hours for a family of thousands) before each failed alone
with a bare digest mismatch. Once :data:`SAME_FOR` different artifacts came back as one
body, the fetch fails at once, naming the page's size and type, and so does every
later answer of that body."""

from __future__ import annotations

import threading

from distcache.artifact import Artifact
from distcache.errors import OriginError

#: Different artifacts answered with one wrong body that make it the origin's answer to
#: every path: two could be files a broken mirror left alike (empty ones, say).
SAME_FOR = 3
#: Wrong bodies remembered, at most (the first ones).
KEPT = 256

#: A wrong body: its sha256 (blank where it was refused by its announced length
#: before it was read), its length, its Content-Type.
Body = tuple[str, int, str]


class SameAnswers:
    """The wrong bodies an origin answered with, and the artifacts each answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[Body, dict[str, str]] = {}

    def check(self, body: Body, artifact: Artifact, where: str) -> None:
        """Count ``body`` as the answer to ``artifact`` (fetched from ``where``).

        Raises:
            OriginError: :data:`SAME_FOR` different artifacts were answered with it.
        """
        with self._lock:
            answered = self._seen.get(body)
            if answered is None:
                if len(self._seen) >= KEPT:
                    return
                answered = self._seen[body] = {}
            answered.setdefault(artifact.sha256, artifact.name)
            if len(answered) < SAME_FOR:
                return
            names = sorted(answered.values())
        digest, size, kind = body
        what = (f"{size} bytes" + (f" of {kind}" if kind else "")
                + (f", sha256 {digest[:16]}..." if digest else " announced"))
        shown = ", ".join(names[:SAME_FOR]) + (
            f" and {len(names) - SAME_FOR} more" if len(names) > SAME_FOR else "")
        raise OriginError(
            f"GET {where}: the origin answers different artifacts with the same body "
            f"({what}), which is none of them ({shown}): it serves one page for every "
            "path (a sign-in page, a portal or an index), not the artifacts; check the "
            "origin URL (DISTCACHE_ORIGIN or --origin) and that it names a mirror of them",
            url=where, status=200, name=artifact.name)

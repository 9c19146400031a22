"""FlashInfer's repository is recognised however its URL is written.

Whether a miss goes to the repository FlashInfer's own loader downloads from decides
whether that repository's "not found" is final. The origin's description (user-info
left out, the host in lower case) was compared with the variable as written, so a
FLASHINFER_CUBINS_REPOSITORY holding user-info or an upper-case host never matched:
one missing kernel then cost FlashInfer's own retries (46 s and 5 requests, against
1 request at once). Another path, port or host is still another place (the guards).
"""

from __future__ import annotations

import pytest

from distcache.config import settings
from distcache.integrations.flashinfer._install import _is_flashinfers_repository
from distcache.origins import HttpOrigin

ORIGIN = "http://mirror.example:8080/cubins"


@pytest.mark.parametrize(("repository", "same"), [
    ("http://mirror.example:8080/cubins/", True),
    ("http://user:pw@mirror.example:8080/cubins", True),
    ("http://MIRROR.Example:8080/cubins", True),
    ("http://mirror.example:8080/cubins?token=x", True),
    ("http://mirror.example:8081/cubins", False),
    ("http://mirror.example:8080/other", False),
    ("https://mirror.example:8080/cubins", False),
    ("http://other.example:8080/cubins", False),
])
def test_the_repository_is_recognised_in_any_spelling(
    monkeypatch: pytest.MonkeyPatch, repository: str, same: bool,
) -> None:
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", repository)
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    origin = HttpOrigin(ORIGIN)
    try:
        assert _is_flashinfers_repository(origin, settings({})) is same
    finally:
        origin.close()
    conf = settings({"DISTCACHE_ORIGIN": ORIGIN})
    assert _is_flashinfers_repository(None, conf) is same

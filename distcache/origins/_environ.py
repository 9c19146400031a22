"""The proxies the environment names for a URL, as requests reads them, read again
only when a variable that names a proxy changes.

requests reads them for every request (``Session.merge_environment_settings``): it
goes through every variable of the environment twice, decoding each name and value.
That is 0.5 ms a request with 185 variables (an MPI or Slurm job) and 2.9 ms with
735 (a Kubernetes pod with many services): seconds of CPU for a family of thousands
of kernels. Here the answer is kept per scheme, host and ``no_proxy`` for as long as
the variables whose names end in ``_proxy`` (and ``REQUEST_METHOD``, which makes
urllib drop ``http_proxy``) hold the same values; the rest of the merge is requests'
own, unchanged.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import urlsplit

from requests.sessions import merge_setting
from requests.utils import get_environ_proxies

#: Answers kept at most (per scheme, host and ``no_proxy``); all are dropped past it.
_KEPT = 256
_answers: dict[tuple[str, str, str | None, tuple[tuple[str, str], ...]], dict[str, str]] = {}
_lock = threading.Lock()


def _proxy_variables() -> tuple[tuple[str, str], ...]:
    """The variables urllib reads proxies from: every name ending in ``_proxy`` (any
    case), and ``REQUEST_METHOD``."""
    return tuple(sorted((name, os.environ.get(name, "")) for name in os.environ
                        if name[-6:].lower() == "_proxy" or name == "REQUEST_METHOD"))


def environ_proxies(url: str, no_proxy: str | None) -> dict[str, str]:
    """``requests.utils.get_environ_proxies(url, no_proxy=no_proxy)``, read again only
    when a proxy variable changed since it was last read for this scheme and host."""
    parts = urlsplit(url)
    key = (parts.scheme, parts.netloc, no_proxy, _proxy_variables())
    with _lock:
        known = _answers.get(key)
    if known is None:
        known = dict(get_environ_proxies(url, no_proxy=no_proxy))
        with _lock:
            if len(_answers) >= _KEPT:
                _answers.clear()
            _answers[key] = known
    return dict(known)


def merge_environment(session: Any, url: str, proxies: dict[str, str] | None,
                      stream: bool | None, verify: Any, cert: Any) -> dict[str, Any]:
    """What ``session.merge_environment_settings`` returns (requests' steps, its
    environment's proxies from :func:`environ_proxies`)."""
    if session.trust_env:
        no_proxy = proxies.get("no_proxy") if proxies is not None else None
        found = environ_proxies(url, no_proxy)
        if proxies is not None:
            for k, v in found.items():
                proxies.setdefault(k, v)
        if verify is True or verify is None:
            verify = (os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
                      or verify)
    return {"proxies": merge_setting(proxies, session.proxies),
            "stream": merge_setting(stream, session.stream),
            "verify": merge_setting(verify, session.verify),
            "cert": merge_setting(cert, session.cert)}

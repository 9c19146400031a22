"""What a proxy between an HTTP origin and this process did (``HTTPS_PROXY``,
``HTTP_PROXY``, ``NO_PROXY``, as requests reads them).

A proxy that refuses the tunnel to the origin (a ``CONNECT`` answered 407 for want of
its credentials, 403 by its policy) answers every attempt the same:
:func:`refused_tunnel` tells that from a proxy that could not reach the origin (502,
504), which another attempt may get past. :func:`through_proxy` names the proxy a
failed connection went to, so that a proxy that is down is not taken for the origin.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import requests
from requests.utils import get_environ_proxies, select_proxy

from distcache._urls import redact_url

# How http.client and urllib3 word a refused CONNECT: "Tunnel connection failed: 407 ...".
_TUNNEL = re.compile(r"Tunnel connection failed: ([0-9]{3})\b")
# Refusals another attempt may get past: a timeout, too early, too many requests.
_PASSING = {408, 425, 429}


def refused_tunnel(errors: Iterable[BaseException]) -> int | None:
    """The status a proxy refused the tunnel to the origin with, found among
    ``errors`` (an exception and those it links to), when it would refuse every
    attempt so (a 4xx other than 408, 425 and 429); else None."""
    for error in errors:
        match = _TUNNEL.search(str(error)) if isinstance(error, OSError) else None
        if match is not None:
            status = int(match.group(1))
            return status if 400 <= status < 500 and status not in _PASSING else None
    return None


def through_proxy(exc: BaseException) -> str:
    """``" at the proxy <its URL>"`` (without user-info and query) when ``exc`` (from
    requests) is a failure to reach the proxy its request was sent through; else
    ``""``."""
    if not isinstance(exc, requests.exceptions.ProxyError):
        return ""
    url = getattr(exc.request, "url", None)
    proxy = select_proxy(url, get_environ_proxies(url)) if isinstance(url, str) else None
    return f" at the proxy {redact_url(proxy)}" if proxy else " at the proxy"

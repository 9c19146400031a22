"""vLLM: a ``vllm.general_plugins`` entry point that serves FlashInfer's loader from
the distcache pool in every vLLM process.

vLLM calls every general plugin in each process it creates (the API server, the
engine core, every worker) before that process starts work, possibly more than once;
``VLLM_PLUGINS`` (comma-separated names) restricts which run, and this one is named
``distcache``. :func:`register` is non-collective and idempotent, never raises (vLLM
does not catch a plugin's exception), and does nothing with ``DISTCACHE_DISABLE=1`` or
``DISTCACHE_FLASHINFER=0`` or when FlashInfer is not installed. See
:mod:`distcache.integrations._autoinstall` for the pool and origin it uses.
"""

from __future__ import annotations

from distcache.integrations._autoinstall import arm

__all__ = ["register"]


def register() -> None:
    """The entry point: arm the FlashInfer wrapper in this process."""
    arm("vllm")

"""vLLM: a ``vllm.general_plugins`` entry point that serves FlashInfer's loader from
the distcache pool in every vLLM process.

vLLM calls every general plugin in each process it creates (the API server, the
engine core, every worker) before that process starts work, possibly more than once;
``VLLM_PLUGINS`` (comma-separated names) restricts which run, and this one is named
``distcache``. :func:`register` is non-collective and idempotent, never raises (vLLM
does not catch a plugin's exception), and does nothing with ``DISTCACHE_DISABLE=1``;
``DISTCACHE_FLASHINFER=0``, or FlashInfer not being installed, leaves out the wrapper.
With ``DISTCACHE_JIT_CACHES=vllm,inductor`` it also fills vLLM's torch.compile cache
and Inductor's directory from the pool before vLLM compiles, and the first vLLM process
publishes them when it exits. Each process reports what it did as one ``engine.hook``
event to ``DISTCACHE_LOG_JSON``. See :mod:`distcache.integrations._autoinstall` for
the pool and origin it uses.
"""

from __future__ import annotations

from distcache.integrations._autoinstall import arm

__all__ = ["register"]


def register() -> None:
    """The entry point: arm the FlashInfer wrapper and fill the JIT caches in this
    process."""
    arm("vllm")

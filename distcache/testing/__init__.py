"""Test stand-ins that ship with distcache: a loopback HTTP origin with faults on
demand and a generator of FlashInfer-like artifact sets. Used by distcache's own
tests and usable by engines that test their integration."""

from __future__ import annotations

from distcache.testing._artifacts import make_artifacts
from distcache.testing._origin_server import FAULTS, LoopbackOrigin

__all__ = ["FAULTS", "LoopbackOrigin", "make_artifacts"]

"""The ``distcache`` command: inspect and fill artifact pools, check a machine.

    distcache [--pool DIR] [--verbose] pool ls|stats|verify|gc [--json]
    distcache [--pool DIR] pool import WHEEL|TARBALL|DIR [--arch SM ...] [--json]
    distcache [--pool DIR] pool export DIR | --tar FILE [--manifest M] [--json]
    distcache [--pool DIR] pool rm NAME|GLOB ... [--yes|--dry-run] [--json]
    distcache [--pool DIR] pool prune --older-than DURATION [--yes|--dry-run] [--json]
    distcache [--pool DIR] fetch --manifest FILE [--origin URL ...] [--jobs N] [--json]
    distcache [--pool DIR] doctor [--json]
    distcache [--pool DIR] prefetch --manifest FILE | --flashinfer [--record DIR]
              [--family NAME ... [--arch SM ...]] [--dry-run] [--json]  (every rank)

The pool is ``--pool``, else ``DISTCACHE_POOL``, else ``$XDG_CACHE_HOME/distcache``;
``--pool`` and ``--verbose`` may stand before or after any subcommand. ``--json``
prints a command's result as one JSON document on stdout instead of text. Logging
(:func:`distcache._logging.configure_logging`): a collective command prints rank 0's
progress, one line per phase, and every rank's warnings; ``-v`` every rank's progress
and debug lines, tagged with the rank; a command that is not collective prints its
result and its warnings.

Exit codes:
    0    success
    1    an error: one line on stderr (``--verbose`` adds the traceback); also a
         ``pool gc`` that could not get under its cap
    2    bad usage (unknown command or option, missing argument)
    3    ``pool verify`` found corrupt objects (they were moved to quarantine/)
    130  interrupted (running downloads stop at once; their temporary files go)

One module per subcommand (``_pool``, ``_transfer`` for pool import/export,
``_hygiene`` for pool rm/prune, ``_fetch``, ``_doctor``, ``_prefetch`` and ``_dryrun``), registered through one table in ``_main``;
the option convention, exit codes and text-or-JSON output are in ``_common``. Only
the CLI configures logging. Nothing here imports torch, except ``doctor`` on a
machine with an NVIDIA device node where torch is installed, and ``prefetch`` when
its communicator is torch's.
"""

from __future__ import annotations

from distcache.cli._main import main

__all__ = ["main"]

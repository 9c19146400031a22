"""``python -m distcache``: the ``distcache`` command."""

from distcache.cli import main

raise SystemExit(main())

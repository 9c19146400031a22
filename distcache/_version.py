"""The version of distcache, in one place: the package, the CLI and the origins'
``User-Agent`` read it here; the packaging test checks ``pyproject.toml`` agrees."""

__version__ = "0.1.0"

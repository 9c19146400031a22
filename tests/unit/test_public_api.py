"""The public names are the contract: guard them, and keep `import distcache` light."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import distcache
import distcache.errors

PUBLIC = {
    "Artifact",
    "parse_checksums",
    "ArtifactPool",
    "HttpOrigin",
    "DirOrigin",
    "OriginChain",
    "prefetch",
    "sync",
    "PrefetchReport",
    "init",
    "Session",
    "comm",
    "errors",
    "ipc",
    "integrations",
    "config",
    "__version__",
}


def test_all_lists_exactly_the_public_names() -> None:
    assert set(distcache.__all__) == PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC - {"__version__"}))
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(distcache, name) is not None


@pytest.mark.parametrize(
    "name",
    [
        "Artifact",
        "parse_checksums",
        "ArtifactPool",
        "HttpOrigin",
        "DirOrigin",
        "prefetch",
        "sync",
        "init",
    ],
)
def test_public_callables_document_what_they_raise(name: str) -> None:
    obj = getattr(distcache, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "Raises:" not in doc:
        doc = inspect.getdoc(obj.__init__) or ""
    assert "Raises:" in doc, f"{name} has no 'Raises:' section"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = distcache.no_such_name  # type: ignore[attr-defined]


def test_importing_the_packages_imports_neither_torch_nor_mpi4py() -> None:
    code = (
        "import sys, distcache, launch, distcache.comm, distcache.ipc, distcache.store._pool, "
        "distcache.origins._origin, distcache.collective._core, distcache.session, distcache.cli, "
        "distcache.integrations.flashinfer\n"
        "bad = [m for m in ('torch', 'mpi4py', 'flashinfer') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == ""


def test_error_leaves_subclass_the_builtin_they_mean() -> None:
    e = distcache.errors
    assert issubclass(e.ArtifactNameError, ValueError)
    assert issubclass(e.ConfigError, ValueError)
    assert issubclass(e.PoolError, OSError)
    assert issubclass(e.CollectiveTimeout, TimeoutError)
    assert issubclass(e.StaleHandleError, e.IpcError)

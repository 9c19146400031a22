"""The public names are the contract: guard them, and keep `import distcache` light."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from typing import Any

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
    "InitOptions",
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
        "import sys, distcache, launch, distcache.comm, distcache.ipc, distcache.store, "
        "distcache.origins, distcache.collective, distcache.session, distcache.cli, "
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


# -- signatures of the contract (DESIGN.md, "Contracts") -------------------------------
# Each entry: dotted path -> the parameters the contract names, in order, as
# "name" (required positional), "name=" (positional with a default), "*name" (required
# keyword-only), "*name=" (keyword-only with a default). Extra trailing parameters
# with defaults are allowed: they extend the contract without breaking callers.
SIGNATURES: dict[str, list[str]] = {
    "distcache.Artifact": ["name", "sha256", "size="],
    "distcache.parse_checksums": ["text", "prefix="],
    "distcache.ArtifactPool": ["root", "*max_bytes="],
    "distcache.ArtifactPool.get": ["self", "sha256"],
    "distcache.ArtifactPool.put": ["self", "data", "sha256="],
    "distcache.ArtifactPool.fetch": ["self", "artifact", "origin"],
    "distcache.ArtifactPool.materialize": ["self", "artifact", "into_dir"],
    "distcache.ArtifactPool.gc": ["self", "max_bytes="],
    "distcache.ArtifactPool.verify": ["self"],
    "distcache.ArtifactPool.stats": ["self"],
    "distcache.HttpOrigin": ["base_url", "*timeout=", "*retries=", "*headers="],
    "distcache.DirOrigin": ["path"],
    "distcache.prefetch": ["artifacts", "*comm", "*pool", "*origin"],
    "distcache.sync": ["*comm", "*pool"],
    "distcache.init": ["options="],
    "distcache.InitOptions": ["manifests=", "integrations=", "ipc_pools=", "pool=", "origin=",
                              "comm=", "timeout=", "transport=", "background=", "environ="],
    "distcache.session.SessionSlot.init": ["self", "options="],
    "distcache.Session.close": ["self"],
    "distcache.comm.auto": [],
    "distcache.comm.from_mpi": ["mpi_comm="],
    "distcache.comm.from_torch": ["group="],
    "distcache.comm.local": [],
    "distcache.comm.Communicator.broadcast_bytes": ["self", "data", "root"],
    "distcache.comm.Communicator.allgather_object": ["self", "obj"],
    "distcache.comm.Communicator.barrier": ["self"],
    "distcache.comm.Communicator.split": ["self", "color"],
    "distcache.ipc.ShmPool": ["capacity_bytes"],
    "distcache.ipc.CudaPool": ["capacity_bytes", "device"],
    "distcache.ipc.ShmPool.put": ["self", "tensor", "consumers=", "*with_descriptor="],
    "distcache.ipc.CudaPool.put": ["self", "tensor", "consumers=", "*with_descriptor="],
    "distcache.ipc.PoolRegistry.exchange": ["comm", "pools"],
    "distcache.ipc.PoolRegistry.resolve": ["self", "ref"],
    "distcache.ipc.PoolRegistry.ack": ["self", "ref"],
    "distcache.ipc.PoolRegistry.add": ["self", "descriptor"],
    "distcache.ipc.PoolRegistry.fetch": ["self", "ref", "out=", "stream="],
    "distcache.ipc.PoolRegistry.view": ["self", "ref"],
    "distcache.ipc.PoolDescriptor.pack": ["self"],
    "distcache.ipc.PoolDescriptor.unpack": ["data"],
    "distcache.ipc.PoolRegistry.close": ["self"],
    "distcache.ipc.FeatureRef.pack": ["self"],
    "distcache.ipc.FeatureRef.unpack": ["data"],
    "distcache.integrations.flashinfer.install": ["pool", "origin=", "record="],
    "distcache.integrations.flashinfer.uninstall": [],
    "launch.detect": ["environ="],
    "launch.init_process_group": ["info=", "backend="],
    "launch.expand_nodelist": ["text"],
}

#: Attributes the contract names on objects that have no signature to check.
ATTRIBUTES: dict[str, list[str]] = {
    "distcache.comm.Communicator": ["rank", "size", "node_id", "broadcast_bytes",
                                    "allgather_object", "barrier", "split"],
    "distcache.ipc.PoolRegistry": ["exchange", "add", "fetch", "resolve", "ack", "view", "close"],
    "distcache.ipc.ShmPool": ["put", "reclaim", "cancel", "descriptor", "bind", "close"],
    "distcache.ipc.FeatureRef": ["pack", "unpack"],
    "distcache.Session": ["comm", "pool", "report", "options", "wait", "sync", "close"],
    "distcache.session.SessionSlot": ["current", "init", "leave"],
}
FEATURE_REF_FIELDS = ["pool_id", "epoch", "offset", "nbytes", "dtype", "shape", "strides",
                      "slot", "generation"]
LAUNCH_INFO_FIELDS = ["launcher", "rank", "world_size", "local_rank", "local_world_size",
                      "node_rank", "num_nodes", "node_id", "master_addr", "master_port", "source"]
ERRORS = {
    "ArtifactNameError": ValueError, "IntegrityError": None, "OriginError": None,
    "ArtifactNotFound": None, "PoolError": OSError, "PrefetchError": None,
    "ManifestMismatchError": None, "CollectiveTimeout": TimeoutError, "IpcError": None,
    "StaleHandleError": None, "ConfigError": ValueError, "LaunchError": ValueError,
}


def _lookup(path: str) -> Any:
    module_name, _, rest = path.partition(".")
    obj: Any = importlib.import_module(module_name)
    for part in rest.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def _describe(param: inspect.Parameter) -> str:
    prefix = "*" if param.kind is inspect.Parameter.KEYWORD_ONLY else ""
    suffix = "=" if param.default is not inspect.Parameter.empty else ""
    return f"{prefix}{param.name}{suffix}"


@pytest.mark.parametrize("path", sorted(SIGNATURES))
def test_contract_signature_holds(path: str) -> None:
    obj = _lookup(path)
    params = [p for p in inspect.signature(obj).parameters.values()
              if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    wanted = SIGNATURES[path]
    got = [_describe(p) for p in params]
    assert got[: len(wanted)] == wanted, f"{path}{inspect.signature(obj)}"
    extra = params[len(wanted):]
    assert all(p.default is not inspect.Parameter.empty for p in extra), (
        f"{path}: parameters beyond the contract must have defaults: {got[len(wanted):]}"
    )


@pytest.mark.parametrize("path", sorted(ATTRIBUTES))
def test_contract_attributes_exist(path: str) -> None:
    obj = _lookup(path)
    annotated = set(getattr(obj, "__annotations__", {}))
    missing = [a for a in ATTRIBUTES[path] if not hasattr(obj, a) and a not in annotated
               and a not in getattr(obj, "__slots__", ())]
    assert missing == []


def test_init_takes_the_option_fields_as_keywords() -> None:
    from distcache.session import InitFields

    fields = set(distcache.InitOptions.__match_args__)
    assert InitFields.__optional_keys__ == fields and not InitFields.__required_keys__
    options = distcache.InitOptions()
    with pytest.raises(AttributeError):
        options.background = True  # type: ignore[misc]
    assert options.replace(background=True).background and not options.background


def test_a_registry_counts_opens_per_pool() -> None:
    from distcache.ipc import PoolRegistry, ShmPool

    with ShmPool(1 << 16) as pool:
        registry = PoolRegistry.exchange(distcache.comm.local(), [pool])
        try:
            assert registry.opens == {}  # a producer never maps its own pool
        finally:
            registry.close()


def test_feature_ref_and_launch_info_fields_are_the_contract() -> None:
    import dataclasses

    import launch
    from distcache.ipc import FeatureRef

    ref_fields = [f.name for f in dataclasses.fields(FeatureRef)]
    assert ref_fields[: len(FEATURE_REF_FIELDS)] == FEATURE_REF_FIELDS
    assert list(launch.LaunchInfo.__match_args__) == LAUNCH_INFO_FIELDS
    assert FeatureRef.__dataclass_params__.frozen  # type: ignore[attr-defined]
    info = launch.detect({})
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]
    assert info.replace(rank=0) == info


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_contract_errors_derive_from_distcache_error_and_their_builtin(name: str) -> None:
    cls = getattr(distcache.errors, name)
    assert issubclass(cls, distcache.errors.DistcacheError)
    builtin = ERRORS[name]
    if builtin is not None:
        assert issubclass(cls, builtin)


def test_launch_reexports_its_error_from_the_error_tree() -> None:
    import launch

    assert launch.LaunchError is distcache.errors.LaunchError


@pytest.mark.parametrize(
    "front",
    ["distcache", "distcache.comm", "distcache.ipc", "distcache.store", "distcache.origins",
     "distcache.collective", "distcache.integrations", "distcache.integrations.flashinfer",
     "distcache.testing", "launch"],
)
def test_package_fronts_list_only_names_that_resolve(front: str) -> None:
    module = importlib.import_module(front)
    exported = getattr(module, "__all__", None)
    assert exported, f"{front} has no __all__"
    assert [n for n in exported if not hasattr(module, n)] == []


def test_the_version_is_the_one_the_distribution_declares() -> None:
    import tomllib
    from pathlib import Path

    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert distcache.__version__ == declared["project"]["version"]

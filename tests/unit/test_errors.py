"""The error tree: picklable with attributes, the right builtins, and as documented."""

from __future__ import annotations

import builtins
import pickle
import re

import pytest

import distcache.errors as errors
from distcache.errors import DistcacheError

CLASSES = [getattr(errors, name) for name in errors.__all__]


def _documented_tree() -> dict[str, tuple[str | None, str | None]]:
    """Parse the module docstring's tree: class name -> (parent name, builtin name)."""
    doc = errors.__doc__ or ""
    lines = [ln for ln in doc.splitlines() if re.search(r"(?:── |^\s+DistcacheError\s*$)", ln)]
    tree: dict[str, tuple[str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        match = re.match(
            r"^(?P<indent>[\s│├└─]*?)(?P<name>[A-Za-z_.]+)(?:\s+\((?P<builtin>\w+)\))?", line
        )
        assert match, line
        depth = len(match.group("indent"))
        name = match.group("name")
        while stack and stack[-1][0] >= depth:
            stack.pop()
        tree[name] = (stack[-1][1] if stack else None, match.group("builtin"))
        stack.append((depth, name))
    return tree


def _resolve(name: str) -> type[BaseException]:
    if name.startswith("launch."):
        import launch

        cls = getattr(launch, name.split(".", 1)[1])
    else:
        cls = getattr(errors, name)
    assert isinstance(cls, type) and issubclass(cls, BaseException)
    return cls


def test_documented_tree_lists_every_error_class() -> None:
    tree = _documented_tree()
    assert tree["DistcacheError"] == (None, None)
    assert {name for name in tree if not name.startswith("launch.")} == set(errors.__all__)


def test_documented_parents_and_builtins_match_the_classes() -> None:
    for name, (parent, builtin) in _documented_tree().items():
        cls = _resolve(name)
        if parent is not None:
            assert _resolve(parent) in cls.__bases__, f"{name} should derive from {parent}"
        if builtin is not None:
            assert issubclass(cls, getattr(builtins, builtin)), f"{name} should be a {builtin}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_message_and_attributes(cls: type[DistcacheError]) -> None:
    values = {name: f"{name}-value" for name in cls.declared()}
    original = cls("rank 3/8 on gpu017: it broke", **values)
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == "rank 3/8 on gpu017: it broke"
    assert {name: getattr(copy, name) for name in values} == values
    assert {"rank", "host"} <= set(values)
    assert isinstance(copy, DistcacheError)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_an_undeclared_attribute_is_refused_and_a_declared_one_defaults_to_none(
    cls: type[DistcacheError],
) -> None:
    with pytest.raises(TypeError, match="sha256_typo"):
        cls("message", sha256_typo="x")
    assert all(getattr(cls("message"), name) is None for name in cls.declared())


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ArtifactNameError, ValueError),
        (errors.ManifestError, ValueError),
        (errors.ConfigError, ValueError),
        (errors.PoolError, OSError),
        (errors.CollectiveTimeout, TimeoutError),
    ],
    ids=lambda v: v.__name__,
)
def test_engine_code_can_catch_errors_by_builtin(cls: type[DistcacheError], builtin: type) -> None:
    with pytest.raises(builtin):
        raise cls("x")


def test_collective_timeout_is_a_comm_error_and_stale_handle_an_ipc_error() -> None:
    assert issubclass(errors.CollectiveTimeout, errors.CommError)
    assert issubclass(errors.StaleHandleError, errors.IpcError)


def test_message_property_is_the_whole_text() -> None:
    assert errors.OriginError("404 for x", status=404).message == "404 for x"
    assert errors.OriginError().message == ""

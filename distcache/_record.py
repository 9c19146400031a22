"""Immutable value classes written out, for the types every rank builds at start-up.

``dataclasses`` costs every process that imports it milliseconds of CPU (it loads
``inspect``, ``ast`` and ``dis``) and each decorated class more (its methods are
generated and compiled at import); a job pays that once per rank, on cores the ranks
share. The classes ``distcache.init`` builds on every rank (``InitOptions``,
``Artifact``, ``PrefetchReport``, the pool's layout, the launch description) derive
from :class:`Record` instead: each writes its ``__init__`` and lists its fields in
``_FIELDS``; the base gives equality, hashing, ``repr``, a refusal
to be assigned to (as a frozen dataclass), copying and pickling, :meth:`~Record.replace`
and :meth:`~Record.as_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self


class FrozenError(AttributeError):
    """An attempt to assign to or delete a field of a :class:`Record`."""


class Record:
    """An immutable value: equal, and hashing alike, when its fields are equal.

    A subclass names its fields (what its ``__init__`` takes, in order) in
    ``_FIELDS`` and its slots in ``__slots__`` (the fields, and any it derives);
    ``__init__`` sets them with :meth:`_assign` or :meth:`_set` (plain assignment is
    refused). Fields that ``__init__`` derives from the others are left out of
    ``_FIELDS``: they take no part in equality, ``repr`` or :meth:`replace`.
    """

    __slots__ = ()
    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Positional patterns (``case Artifact(name, sha)``) follow the fields.
        setattr(cls, "__match_args__", cls._FIELDS)  # noqa: B010

    def _set(self, name: str, value: Any) -> None:
        """Set a field (from ``__init__``; the object is not yet shared)."""
        object.__setattr__(self, name, value)

    def _assign(self, *values: Any) -> None:
        """Set every field of ``_FIELDS``, in order (from ``__init__``)."""
        for name, value in zip(self._FIELDS, values, strict=True):
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenError(f"cannot assign to field {name!r} of {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise FrozenError(f"cannot delete field {name!r} of {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Record)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, *self._values()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"{type(self).__qualname__}({shown})"

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` in place of the fields they name.

        Raises:
            TypeError: a name that is not a field.
        """
        unknown = sorted(set(changes) - set(self._FIELDS))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {', '.join(unknown)}; "
                            f"its fields are {', '.join(self._FIELDS)}")
        values = {name: getattr(self, name) for name in self._FIELDS}
        values.update(changes)
        return type(self)(**values)

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (a mapping field is copied into a ``dict``)."""
        return {name: dict(value) if isinstance(value, Mapping) else value
                for name, value in zip(self._FIELDS, self._values(), strict=True)}

    # Copying and pickling: the state is every slot, restored past __setattr__.
    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _slots(type(self))
                if hasattr(self, name)}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


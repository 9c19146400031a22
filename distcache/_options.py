"""``InitOptions``: what ``distcache.init`` is told, as one frozen value.

The fields fall in three groups, read in this order by the start-up:

* what to fetch: ``manifests``, ``integrations`` (and with them what each wants),
  ``ipc_pools``, ``jit_caches``;
* where from and into: ``pool``, ``origin``;
* how to run: ``comm``, ``timeout``, ``transport``, ``background``, ``environ``.

Every field has a default that reads the ``DISTCACHE_*`` settings, so a call names
only what differs: ``init(manifests=[M])``, ``init(manifests=[M], background=True)``,
or ``init(options)`` with an ``InitOptions`` built once (by a launcher, say).
:class:`InitFields` is the same set of fields as keywords of ``init``.

Integrations are objects, not flags: ``integrations=None`` (the default) is the
default set (FlashInfer when it is importable), a sequence is exactly what is
installed (``()``: none; ``[FlashInfer(record=DIR)]``: FlashInfer with a usage
record). ``DISTCACHE_FLASHINFER=0`` removes FlashInfer from either (:func:`compose`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from distcache._log import get_logger
from distcache._prepare import check_manifests
from distcache._record import Record
from distcache.config import Settings
from distcache.errors import ConfigError
from distcache.integrations import Integration

if TYPE_CHECKING:
    from distcache._resolve import ManifestSpec
    from distcache.comm import Communicator
    from distcache.origins import Origin
    from distcache.store import ArtifactPool


class InitFields(TypedDict, total=False):
    """The fields of :class:`InitOptions` as keywords (``init(**fields)``); each is
    optional and means what the field of the same name means."""

    manifests: Sequence[ManifestSpec]
    integrations: Sequence[Integration] | None
    ipc_pools: Sequence[Any] | None
    jit_caches: Sequence[str] | None
    pool: ArtifactPool | str | os.PathLike[str] | None
    origin: Origin | str | Sequence[str] | None
    comm: Communicator | None
    timeout: float | None
    transport: str | None
    background: bool
    environ: Mapping[str, str] | None


class InitOptions(Record):
    """Everything ``distcache.init`` is told; the same on every rank.

    What to fetch:
        manifests: ``sha256sum``-format files or lists of artifacts to prefetch.
        integrations: consumers of artifacts to serve from the pool; what they want
            (on any rank) is prefetched, then each is installed. ``None``: the default
            set (FlashInfer when importable); a sequence: exactly those (``()``:
            none). ``DISTCACHE_FLASHINFER=0`` removes FlashInfer.
        ipc_pools: this rank's IPC producer pools; when given (even empty) the
            registry exchange runs (collectively).
        jit_caches: JIT compile caches kept in the pool, by name (``"inductor"``,
            ``"triton"``, ``"deep_gemm"``, ``"flashinfer_jit"``, ``"vllm"``; see
            :mod:`distcache.jit`): what the pools hold for them is prefetched and
            their directories filled before the engine compiles;
            ``Session.sync()`` publishes what each rank built. ``None``:
            ``DISTCACHE_JIT_CACHES``.

    Where from and into:
        pool: an ``ArtifactPool`` or its directory; default ``DISTCACHE_POOL``.
        origin: where missing artifacts come from; default ``DISTCACHE_ORIGIN``, else
            the first default an integration offers.

    How to run:
        comm: a communicator; default: one of distcache's own from
            :func:`distcache.comm.adopt` (a duplicate of the MPI world under MPI, else
            a private gloo group on the launcher's rendezvous store, else world size
            1). torch.distributed's default group is never initialised, adopted or
            destroyed.
        timeout: seconds for each collective (default ``DISTCACHE_TIMEOUT``).
        transport: how the prefetch moves bulk bytes: ``"default"`` (over the MPI or
            gloo communicator) or ``"nccl"`` (a dedicated NCCL group made for the
            prefetch and destroyed after it); default ``DISTCACHE_TRANSPORT``.
        background: run the prefetch and the integrations' install on a thread over
            distcache's own communicator and return at once; ``Session.wait`` joins
            it (and raises what it raised, on every rank alike).
        environ: the environment to read settings and the launch from (default
            ``os.environ``).
    """

    _FIELDS = ("manifests", "integrations", "ipc_pools", "pool", "origin", "comm",
                 "timeout", "transport", "background", "environ", "jit_caches")
    __slots__ = _FIELDS
    manifests: Sequence[ManifestSpec]
    integrations: Sequence[Integration] | None
    ipc_pools: Sequence[Any] | None
    pool: ArtifactPool | str | os.PathLike[str] | None
    origin: Origin | str | Sequence[str] | None
    comm: Communicator | None
    timeout: float | None
    transport: str | None
    background: bool
    environ: Mapping[str, str] | None
    jit_caches: Sequence[str] | None

    def __init__(
        self,
        manifests: Sequence[ManifestSpec] = (),
        integrations: Sequence[Integration] | None = None,
        ipc_pools: Sequence[Any] | None = None,
        pool: ArtifactPool | str | os.PathLike[str] | None = None,
        origin: Origin | str | Sequence[str] | None = None,
        comm: Communicator | None = None,
        timeout: float | None = None,
        transport: str | None = None,
        background: bool = False,
        environ: Mapping[str, str] | None = None,
        jit_caches: Sequence[str] | None = None,
    ) -> None:
        self._assign(manifests, integrations, ipc_pools, pool, origin, comm, timeout,
                     transport, background, environ, jit_caches)

    @classmethod
    def of(cls, options: InitOptions | None, fields: Mapping[str, Any]) -> InitOptions:
        """``options`` (default: all defaults) with ``fields`` in place of its own.

        Raises:
            ConfigError: ``options`` is not an ``InitOptions``, ``fields`` names
                something that is not a field (the message names the fields), or a
                field has the wrong shape (:func:`check_fields`).
        """
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise ConfigError(
                f"init's positional argument must be an InitOptions, got {options!r}; "
                "pass the options as keywords (init(manifests=[...]))",
                variable="options", value=repr(options))
        known = list(cls._FIELDS)
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ConfigError(
                f"init got unknown option(s) {', '.join(unknown)}; the options are "
                f"{', '.join(known)} (FlashInfer is an integration: "
                "integrations=[FlashInfer(record=DIR)] records, integrations=() leaves it "
                "out)", variable=unknown[0], value=None)
        chosen = base.replace(**fields) if fields else base
        if not isinstance(chosen.background, bool):
            raise ConfigError(f"init's background={chosen.background!r} must be True or False",
                              variable="background", value=repr(chosen.background))
        check_fields(chosen)
        return chosen

    def warn_ignored(self, options: InitOptions | None, fields: Mapping[str, Any]) -> list[str]:
        """Log a warning naming the fields a later ``init(options, **fields)`` names (as
        keywords, or in ``options`` away from their defaults) with values other than
        these, which the open session ignores; return those fields."""
        asked = InitOptions.of(options, fields)  # first: a bad argument is a ConfigError
        default = InitOptions()
        named = set(fields) | {n for n in self._FIELDS if options is not None
                               and not _same(getattr(options, n), getattr(default, n))}
        ignored = sorted(n for n in named
                         if not _same(_as_compared(n, getattr(asked, n)),
                                      _as_compared(n, getattr(self, n))))
        if ignored:
            log.warning("init was called again with other %s; the open session keeps "
                        "those of the first call: the new ones are ignored", ", ".join(ignored))
        return ignored

    def __repr__(self) -> str:
        """The fields, but no value of ``environ`` (tokens) nor an origin URL's
        user-info or query (a password, a token as the user name, a signature)."""
        shown = {name: repr(getattr(self, name)) for name in self._FIELDS}
        if self.environ is not None:
            shown["environ"] = f"<{len(self.environ)} variables>"
        shown["origin"] = repr(_redacted(self.origin))
        return "InitOptions(" + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")"


def check_fields(options: InitOptions) -> None:
    """Refuse a field of ``options`` whose shape the start-up cannot use, before
    anything is set up: a pool that is not an ``ArtifactPool`` or a directory (a blank
    one would be the current directory), manifests that are not a list of manifests,
    a comm that is not a distcache ``Communicator``, integrations, IPC pools or JIT
    caches that are not a list (of producer pools, of names), an environ that is not
    a mapping of strings.

    Raises:
        ConfigError: naming the field (or the variable of ``environ``) and the shape
            expected.
    """
    _check_pool(options.pool)
    check_manifests(options.manifests)
    _check_comm(options.comm)
    _check_list("integrations", options.integrations, "[FlashInfer(record=DIR)]")
    _check_list("ipc_pools", options.ipc_pools, "[pool]")
    _check_ipc_pools(options.ipc_pools)
    _check_names(options.jit_caches)
    _check_environ(options.environ)


def _check_pool(pool: object) -> None:
    from distcache.store import ArtifactPool  # loaded by the start-up anyway

    if pool is None or isinstance(pool, ArtifactPool):
        return
    path = os.fspath(pool) if isinstance(pool, str | os.PathLike) else None
    if not isinstance(path, str):
        raise ConfigError(f"init's pool={_shown(pool)} must be an ArtifactPool or a "
                          "directory (a str or os.PathLike path)", variable="pool",
                          value=_shown(pool))
    if not path.strip():
        # As the command's --pool: an empty name would be the current directory.
        raise ConfigError(f"init's pool={pool!r} is an empty directory name; pass a "
                          "directory, or leave pool out for DISTCACHE_POOL",
                          variable="pool", value=path)


def _check_comm(comm: object) -> None:
    from distcache.comm import Communicator

    if comm is None or isinstance(comm, Communicator):
        return
    raise ConfigError(
        f"init's comm={_shown(comm)} must be a distcache Communicator; an mpi4py "
        "communicator is taken through distcache.comm.from_mpi(...) "
        "(comm=distcache.comm.from_mpi(MPI.COMM_WORLD)), and without comm distcache "
        "adopts its own", variable="comm", value=_shown(comm))


def _check_list(keyword: str, value: object, example: str, of: str = "") -> None:
    """Refuse ``value`` for ``keyword`` unless it is ``None`` or a list (any iterable
    but a string) ``of`` what it should hold: a single object or a string is not one."""
    if value is None or (isinstance(value, Iterable) and not isinstance(value, str | bytes)):
        return
    what = f"the string {value!r}" if isinstance(value, str | bytes) else _shown(value)
    raise ConfigError(f"{keyword} must be a list{of} ({keyword}={example}), not {what}",
                      variable=keyword, value=_shown(value))


def _check_items(keyword: str, value: object, kind: type | tuple[type, ...], what: str
                 ) -> None:
    """Refuse a list for ``keyword`` with an item that is not a ``kind`` (``what``);
    an iterable that is not a sequence is left unread (it may be read once only)."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return
    for item in value:
        if not isinstance(item, kind):
            raise ConfigError(f"{keyword} must list {what} each, not {_shown(item)}",
                              variable=keyword, value=_shown(item))


def _check_names(names: object) -> None:
    """``jit_caches``: a list of names (``None``: ``DISTCACHE_JIT_CACHES``)."""
    _check_list("jit_caches", names, '["inductor"]', " of names")
    _check_items("jit_caches", names, str, "a cache's name")


def _check_ipc_pools(pools: object) -> None:
    if isinstance(pools, Sequence) and pools:
        from distcache.ipc._producer import ProducerPool  # loaded by the jobs that map pools

        _check_items("ipc_pools", pools, ProducerPool,
                     "a producer pool (distcache.ipc.ShmPool or CudaPool)")


def _check_environ(environ: object) -> None:
    if environ is None:
        return
    if not isinstance(environ, Mapping):
        raise ConfigError(f"environ must be a mapping of variable names to strings (such "
                          f"as os.environ or a dict), not {_shown(environ)}",
                          variable="environ", value=_shown(environ))
    for name, value in environ.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigError(
                f"environ[{name!r}]={_shown(value)}: environ must be a mapping of strings "
                "to strings, each value as the environment holds it (such as '1')",
                variable=str(name), value=_shown(value))


def _shown(value: object) -> str:
    """``repr(value)``, cut to 120 characters for a message."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:120]}..."


def _as_compared(name: str, value: Any) -> Any:
    """``value`` of the field ``name`` as two calls that mean the same give it alike: a
    list and a tuple as a tuple, and the pool's and the manifests' paths (a ``str`` or
    a path object, with or without a trailing ``/``) as absolute paths."""
    def path(item: Any) -> Any:
        return os.path.abspath(os.fspath(item)) if isinstance(item, str | os.PathLike) else item

    if name == "pool":
        return path(value)
    if isinstance(value, list | tuple):
        return tuple(path(item) if name == "manifests" else item for item in value)
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two option values are equal (a comparison that fails says no)."""
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def _redacted(origin: Any) -> Any:
    """``origin`` with each origin string, in a comma-separated list or a sequence,
    shown through :func:`~distcache._urls.redact_url`; an Origin
    object's own repr already hides its secrets."""
    from distcache._urls import redact_url  # at the first repr

    if isinstance(origin, str):
        # Each entry as the origin list reads it (spaces around the commas dropped).
        return ",".join(redact_url(part.strip()) for part in origin.split(","))
    if isinstance(origin, tuple):
        return tuple(map(_redacted, origin))
    if isinstance(origin, Sequence):
        return list(map(_redacted, origin))
    return origin

log = get_logger(__name__)

_FLASHINFER = "distcache.integrations.flashinfer"


def compose(integrations: Sequence[Integration] | None, conf: Settings) -> list[Integration]:
    """The integrations ``init`` installs: ``integrations`` as given, or the default
    set when ``None`` (FlashInfer, when it is importable); without FlashInfer when
    ``DISTCACHE_FLASHINFER=0``.

    Raises:
        ConfigError: ``integrations`` holds something that is not an integration.
    """
    # FlashInfer's integration (and what it imports) is loaded only when init's default
    # set is asked for: a job that names its integrations, or none, never imports it.
    if integrations is None:
        from distcache.integrations.flashinfer import FlashInfer

        default = FlashInfer()
        chosen: list[Integration] = [default] if default.available() else []
    else:
        chosen = list(integrations)
    for integration in chosen:
        if not isinstance(integration, Integration):
            raise ConfigError(
                f"{integration!r} is not an Integration (name, available(), "
                "default_origin(), manifest(), install(), uninstall(), materialize_dir())",
                variable="integrations", value=repr(integration),
            )
    if not conf.flashinfer and _FLASHINFER in sys.modules:
        # Without the module loaded, no integration here can be FlashInfer's.
        from distcache.integrations.flashinfer import FlashInfer

        return [i for i in chosen if not isinstance(i, FlashInfer)]
    return chosen


def jit_families(names: Sequence[str] | None, conf: Settings, pool: ArtifactPool,
                 environ: Mapping[str, str] | None) -> list[Integration]:
    """The JIT cache families ``init`` adds to the integrations: ``names``, else
    ``DISTCACHE_JIT_CACHES``, bound to ``pool``.

    Raises:
        ConfigError: ``names`` names an unknown family (its shape was checked with the
            rest of the options: :func:`check_fields`).
    """
    chosen = conf.jit_caches if names is None else tuple(names)
    if not chosen:
        return []  # distcache.jit is loaded by the jobs that use a family
    from distcache.jit import families

    return list(families(chosen, pool=pool, environ=environ))

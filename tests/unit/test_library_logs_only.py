"""The library only logs: no module of ``distcache`` outside the programs (``cli/`` and
their logging set-up, ``_logging.py``) prints, writes to stdout or stderr, or
configures logging; what a job shows is the programs' (or the application's) choice.

The one exception is rank 0's progress bar, drawn on a terminal only
(``collective/_progress.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "distcache"
#: The programs' own modules, which may print and configure logging.
PROGRAMS = ("cli/", "_logging.py", "__main__.py")
#: A tqdm bar on stderr when stderr is a terminal: not a log line.
TERMINAL_BAR = "collective/_progress.py"
#: logging calls that change what is shown, not what is logged.
CONFIGURES = {"basicConfig", "addHandler", "removeHandler", "dictConfig", "fileConfig",
              "setLoggerClass", "captureWarnings"}


def _offences(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "print":
            found.append(f"line {node.lineno}: print()")
        elif isinstance(func, ast.Attribute):
            if func.attr in CONFIGURES:
                found.append(f"line {node.lineno}: .{func.attr}()")
            elif (func.attr in ("write", "writelines") and isinstance(func.value, ast.Attribute)
                  and func.value.attr in ("stdout", "stderr")):
                found.append(f"line {node.lineno}: {func.value.attr}.{func.attr}()")
    return found


def test_no_library_module_prints_or_configures_logging() -> None:
    offences = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = path.relative_to(LIBRARY).as_posix()
        if rel.startswith(PROGRAMS) or rel == TERMINAL_BAR:
            continue
        if found := _offences(path.read_text()):
            offences[rel] = found
    assert offences == {}, (
        f"library modules print or configure logging (use logging.getLogger(__name__)): "
        f"{offences}")


def test_the_scan_finds_each_kind_of_offence() -> None:
    planted = ("import logging, sys\n"
               "print('x')\n"
               "logging.basicConfig()\n"
               "logging.getLogger('a').addHandler(logging.NullHandler())\n"
               "sys.stderr.write('x')\n")
    assert _offences(planted) == ["line 2: print()", "line 3: .basicConfig()",
                                  "line 4: .addHandler()", "line 5: stderr.write()"]
    assert _offences("import logging\nlogging.getLogger(__name__).info('x')\n") == []

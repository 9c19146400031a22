"""Expand Slurm's compressed host lists (``gpu[01-03,07]``) without ``scontrol``.

Grammar, as Slurm writes ``SLURM_STEP_NODELIST``: comma-separated groups at bracket
depth 0; a group is literal text with zero or more ``[...]`` parts; a part is a
comma-separated list of ``N`` or ``N-M``, zero-padded to the width of the low bound.
Several bracket parts in one group form a Cartesian product (``a[1-2]b[3-4]`` is
``a1b3 a1b4 a2b3 a2b4``), the case a first-bracket regex gets wrong
(Lightning-AI/pytorch-lightning#17228 and its ``resolve_root_node_address``).
"""

from __future__ import annotations

import itertools

from distcache.errors import LaunchError

# A typo such as n[0-99999999] must fail, not allocate a billion strings.
MAX_HOSTS = 1_000_000


def _digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits (``str.isdigit`` also takes "²", which ``int``
    refuses, and other scripts' digits, which no launcher writes), at most 18 of them
    past leading zeros and 64 in all (no launcher means more; past 4300 ``int``
    refuses)."""
    return (text.isascii() and text.isdigit() and len(text) <= 64
            and len(text.lstrip("0")) <= 18)


def _bad(text: str, why: str, what: str = "node list") -> LaunchError:
    shown = text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
    return LaunchError(f"malformed Slurm {what} {shown!r}: {why}", variable=what, value=text)


def _split_top_level(text: str) -> list[str]:
    groups: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(text, f"nested '[' at offset {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(text, f"unmatched ']' at offset {i}")
        elif ch == "," and depth == 0:
            groups.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise _bad(text, "unclosed '['")
    groups.append(text[start:])
    return groups


def _expand_range(body: str, text: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if not _digits(low) or (dash and not _digits(high)):
            raise _bad(text, f"range item {item[:40]!r} is not N or N-M (at most 18 digits)")
        lo = int(low)
        hi = int(high) if dash else lo
        if hi < lo:
            raise _bad(text, f"range {item!r} runs backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise _bad(text, f"expands to more than {MAX_HOSTS} hosts")
        width = len(low)
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out


def _expand_group(group: str, text: str) -> list[str]:
    parts: list[list[str]] = []
    rest = group
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            parts.append([rest])
            break
        if open_at:
            parts.append([rest[:open_at]])
        close_at = rest.find("]", open_at)
        body = rest[open_at + 1 : close_at]
        if not body:
            raise _bad(text, "empty '[]'")
        parts.append(_expand_range(body, text))
        rest = rest[close_at + 1 :]
    total = 1
    for p in parts:
        total *= len(p)
    if total > MAX_HOSTS:
        raise _bad(text, f"expands to more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*parts)]


def expand_nodelist(text: str) -> list[str]:
    """Expand a compressed Slurm host list into host names, in Slurm's order.

    >>> expand_nodelist("gpu[01-03,07],cpu1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu1']

    Raises:
        LaunchError: the text is empty, has unbalanced or nested brackets, an empty
            group, a range item that is not ``N``/``N-M``, a backwards range, or
            expands to more than ``MAX_HOSTS`` names.
    """
    if not text.strip():
        raise _bad(text, "no hosts")
    hosts: list[str] = []
    for group in _split_top_level(text):
        group = group.strip()
        if not group:
            raise _bad(text, "empty host group (stray comma)")
        if any(ch.isspace() for ch in group):
            raise _bad(text, f"whitespace inside host group {group!r}")
        hosts.extend(_expand_group(group, text))
        if len(hosts) > MAX_HOSTS:
            raise _bad(text, f"expands to more than {MAX_HOSTS} hosts")
    return hosts


def expand_counts(text: str) -> list[int]:
    """Expand Slurm's per-node task counts (``SLURM_STEP_TASKS_PER_NODE``).

    >>> expand_counts("2(x3),1")
    [2, 2, 2, 1]

    Raises:
        LaunchError: an item is not ``N`` or ``N(xK)``.
    """
    counts: list[int] = []
    for item in text.split(","):
        item = item.strip()
        count, paren, repeat = item.partition("(x")
        if paren:
            if not repeat.endswith(")"):
                raise _bad(text, f"item {item!r} is not N or N(xK)", "task counts")
            repeat = repeat[:-1]
        else:
            repeat = "1"
        if not _digits(count) or not _digits(repeat) or int(repeat) < 1:
            raise _bad(text, f"item {item[:40]!r} is not N or N(xK) (at most 18 digits)",
                       "task counts")
        if len(counts) + int(repeat) > MAX_HOSTS:
            raise _bad(text, f"names more than {MAX_HOSTS} nodes", "task counts")
        counts.extend([int(count)] * int(repeat))
    return counts

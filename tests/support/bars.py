"""A stand-in for tqdm's bar that the collective's progress shows on a terminal."""

from __future__ import annotations

from typing import Any

import pytest


class RecordingBar:
    """Keeps its total, what it was advanced by, and whether it was closed."""

    def __init__(self, made: list[RecordingBar], *_: Any, total: int = 0, **__: Any) -> None:
        self.total = total
        self.n = 0
        self.closed = False
        made.append(self)

    def update(self, nbytes: int) -> None:
        self.n += nbytes

    def close(self) -> None:
        self.closed = True


def recording_bars(monkeypatch: pytest.MonkeyPatch) -> list[RecordingBar]:
    """Show the collective's progress as on a terminal, with :class:`RecordingBar` for
    tqdm; the bars made, in order (clear the list to start counting again)."""
    import tqdm

    from distcache.collective import _progress

    made: list[RecordingBar] = []
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    monkeypatch.setattr(tqdm, "tqdm", lambda *a, **k: RecordingBar(made, *a, **k))
    return made

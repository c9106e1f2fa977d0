"""The process table's passes: one at a time, each shared by every sandbox that asked
before it began, never by one that asked after (that one killed its processes later)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from covey import sandbox
from covey.sandbox import ProcessTable


class RecordingTable:
    """Stands in for /proc: each pass takes a while and says which markers it looked for."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passes: list[frozenset[bytes]] = []
        self.running = 0
        self.most_at_once = 0
        self.started = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, markers: frozenset[bytes]) -> dict[bytes, list[int]]:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.passes.append(markers)
        self.started.set()
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
        return {m: [len(self.passes)] for m in markers}


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> RecordingTable:
    table = RecordingTable(0.2)
    monkeypatch.setattr(sandbox, "processes_marked", table)
    return table


async def test_callers_during_a_pass_share_the_next_one(recording: RecordingTable) -> None:
    table = ProcessTable()
    first = asyncio.ensure_future(table.holders(b"a"))
    await asyncio.to_thread(recording.started.wait, 5)
    later = [asyncio.ensure_future(table.holders(m)) for m in (b"b", b"c", b"d")]
    found = await asyncio.wait_for(asyncio.gather(first, *later), 10)

    assert recording.passes == [frozenset([b"a"]), frozenset([b"b", b"c", b"d"])], (
        "the callers who asked during the first pass must share one pass begun after it")
    assert recording.most_at_once == 1, "two passes over the process table ran side by side"
    assert found == [[1], [2], [2], [2]], "each caller must get the pass begun after it asked"


async def test_a_failed_pass_fails_its_callers_and_the_next_pass_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[frozenset[bytes]] = []

    def failing_once(markers: frozenset[bytes]) -> dict[bytes, list[int]]:
        calls.append(markers)
        if len(calls) == 1:
            raise OSError("no /proc")
        return {m: [7] for m in markers}

    monkeypatch.setattr(sandbox, "processes_marked", failing_once)
    table = ProcessTable()
    with pytest.raises(OSError, match="no /proc"):
        await asyncio.wait_for(table.holders(b"a"), 5)
    assert await asyncio.wait_for(table.holders(b"b"), 5) == [7]

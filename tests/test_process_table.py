"""The process table's passes: one at a time, each shared by every sandbox that asked
before it began, never by one that asked after (that one killed its processes later)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from covey.sandbox import ProcessTable


class RecordingTable:
    """Stands in for /proc: each pass takes a while and says which markers it looked for."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passes: list[frozenset[bytes]] = []
        self.began: list[float] = []
        self.running = 0
        self.most_at_once = 0
        self.started = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, markers: frozenset[bytes]) -> dict[bytes, list[int]]:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.passes.append(markers)
            self.began.append(time.monotonic())
            number = len(self.passes)
        self.started.set()
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
        return {m: [number] for m in markers}


@pytest.fixture
def recording() -> RecordingTable:
    # Given to each table as its pass, not patched into covey.sandbox for the whole worker
    # process: two of these tests failed together in a CI run on a pass neither table could
    # have begun (a third pass; a second one 0.24 s after the first, with no rest between),
    # as if something else in the worker had called the patched function meanwhile.
    return RecordingTable(0.2)


async def test_callers_during_a_pass_share_the_next_one(recording: RecordingTable) -> None:
    table = ProcessTable(scan=recording)
    first = asyncio.ensure_future(table.holders(b"a"))
    await asyncio.to_thread(recording.started.wait, 5)
    later = [asyncio.ensure_future(table.holders(m)) for m in (b"b", b"c", b"d")]
    found = await asyncio.wait_for(asyncio.gather(first, *later), 10)

    assert recording.passes == [frozenset([b"a"]), frozenset([b"b", b"c", b"d"])], (
        "the callers who asked during the first pass must share one pass begun after it")
    assert recording.most_at_once == 1, "two passes over the process table ran side by side"
    assert found == [[1], [2], [2], [2]], "each caller must get the pass begun after it asked"


async def test_a_failed_pass_fails_its_callers_and_the_next_pass_runs() -> None:
    calls: list[frozenset[bytes]] = []

    def failing_once(markers: frozenset[bytes]) -> dict[bytes, list[int]]:
        calls.append(markers)
        if len(calls) == 1:
            raise OSError("no /proc")
        return {m: [7] for m in markers}

    table = ProcessTable(scan=failing_once)
    with pytest.raises(OSError, match="no /proc"):
        await asyncio.wait_for(table.holders(b"a"), 5)
    assert await asyncio.wait_for(table.holders(b"b"), 5) == [7]


async def test_callers_are_not_left_waiting_when_the_pass_is_cancelled(
        recording: RecordingTable) -> None:
    table = ProcessTable(scan=recording)
    first = asyncio.ensure_future(table.holders(b"a"))
    await asyncio.to_thread(recording.started.wait, 5)
    second = asyncio.ensure_future(table.holders(b"b"))
    await asyncio.sleep(0)
    assert table._scanner is not None
    table._scanner.cancel()
    for waiting in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 5)
    # The table still serves: the next caller gets a pass of its own.
    assert await asyncio.wait_for(table.holders(b"c"), 5) == [len(recording.passes)]


async def test_a_pass_is_followed_by_a_rest_before_the_next(recording: RecordingTable) -> None:
    # Each pass takes 0.2 s here, so the next may begin 4 times 0.2 s after it ended, not sooner.
    table = ProcessTable(rest=4, rest_max_s=5, scan=recording)
    await asyncio.wait_for(table.holders(b"a"), 5)
    await asyncio.wait_for(table.holders(b"b"), 5)
    gap = recording.began[1] - recording.began[0]
    assert gap >= 0.2 + 4 * 0.2 - 0.05, (
        f"the second pass began {gap:.2f} s after the first: the table did not rest four "
        "times a pass's length between them")


async def test_the_rest_is_capped(recording: RecordingTable) -> None:
    # A pass that takes long (a loaded host) must not hold a removal's next look for four
    # times as long: the removal has a deadline.
    table = ProcessTable(rest=4, rest_max_s=0.1, scan=recording)
    await asyncio.wait_for(table.holders(b"a"), 5)
    await asyncio.wait_for(table.holders(b"b"), 5)
    gap = recording.began[1] - recording.began[0]
    assert gap < 0.2 + 4 * 0.2 - 0.2, f"the table rested {gap - 0.2:.2f} s, past its cap of 0.1 s"

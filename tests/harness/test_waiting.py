"""A wait fails at once, with the reason, when its outcome cannot come any more."""

from __future__ import annotations

import time

import pytest

from harness.stack.waiting import eventually


async def test_a_wait_for_an_impossible_outcome_fails_at_once_with_the_reason() -> None:
    async def all_done() -> bool:
        return False

    async def why_not() -> str | None:
        return "agent a1 is killed and nobody will resume it"

    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        await eventually(all_done, 60, "tasks left undone after the resume", impossible=why_not)
    assert time.monotonic() - started < 5
    assert str(failure.value).startswith(
        "tasks left undone after the resume: it cannot happen any more, agent a1 is killed "
        "and nobody will resume it")


async def test_an_outcome_that_comes_wins_over_a_late_impossibility() -> None:
    polls = 0

    async def done() -> int:
        nonlocal polls
        polls += 1
        return polls if polls >= 3 else 0

    async def why_not() -> str | None:
        return None

    assert await eventually(done, 10, "never", interval=0.01, impossible=why_not) == 3


async def test_without_an_impossibility_the_deadline_still_fails() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(AssertionError, match=r"the sandbox never went away \(after 0.2s"):
        await eventually(never, 0.2, "the sandbox never went away")

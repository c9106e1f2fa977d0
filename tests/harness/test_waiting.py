"""A wait fails at once, with the reason, when its outcome cannot come any more."""

from __future__ import annotations

import time

import pytest

from harness.stack.waiting import eventually, retried


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


async def test_a_retried_call_is_tried_again_only_on_what_is_worth_it() -> None:
    tries: list[int] = []

    async def flaky() -> int:
        tries.append(len(tries))
        if len(tries) < 3:
            raise ConnectionResetError("reset")
        return len(tries)

    assert await retried(flaky, 5, on=lambda e: isinstance(e, ConnectionResetError)) == 3
    tries.clear()
    with pytest.raises(ConnectionResetError):  # not worth it: the first failure stands
        await retried(flaky, 5, on=lambda e: isinstance(e, TimeoutError))
    assert len(tries) == 1, f"a call retried on an exception it was not told to: {tries}"


async def test_a_retried_call_gives_up_with_its_last_outcome_after_its_tries() -> None:
    answers: list[int] = []
    waits: list[tuple[int, int | None]] = []

    async def shed() -> int:
        answers.append(429)
        return 429

    def wait(attempt: int, result: int | None) -> float:
        waits.append((attempt, result))
        return 0.0

    assert await retried(shed, 4, again=lambda r: r == 429, wait_s=wait) == 429
    assert len(answers) == 4, f"{len(answers)} tries of 4"
    # Each wait is asked with the try it follows and that try's answer (tenacity asks once
    # more after the last try, and does not sleep it).
    assert waits[:3] == [(1, 429), (2, 429), (3, 429)], f"the waits asked: {waits}"

    async def refused() -> int:
        answers.append(0)
        raise OSError("address in use")
    answers.clear()
    with pytest.raises(OSError, match="address in use"):
        await retried(refused, 3, on=lambda e: isinstance(e, OSError))
    assert len(answers) == 3, f"{len(answers)} tries of 3 before the last error was raised"

"""Waiting, the one way: poll with a deadline and fail with a message that says what never
happened. Never a bare sleep (STYLE.md). And retrying, the one way (`retried`, on
tenacity): a call that failed in a way worth trying again, a bounded number of times.

Polling is not retrying: `eventually` waits for a condition of the system to come true;
`retried` repeats one call that failed (a read shed with 429, a request that met a passing
outage, a port taken for a moment) and gives up with that call's last outcome.

A wait for an outcome that can no longer come should not sit out its deadline: a game day
once waited 120 s for tasks to finish while every agent stayed killed, and its message said
less than the check that would have answered at once. `impossible` names why the outcome
cannot come any more (or None while it still can), and the wait fails with that reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
)

T = TypeVar("T")

# How often to ask whether the outcome became impossible: it reads more than the check.
IMPOSSIBLE_EVERY_S = 0.5


async def eventually(check: Callable[[], Awaitable[T | None]], deadline_s: float, message: str,
                     interval: float = 0.05,
                     impossible: Callable[[], Awaitable[str | None]] | None = None) -> T:
    """Poll until check() returns something truthy; fail with `message` at the deadline, or
    as soon as `impossible()` says why it cannot happen any more."""
    __tracebackhide__ = True  # pytest shows the scenario's line that waited, not this loop
    started = time.monotonic()
    deadline = started + deadline_s
    asked = float("-inf")
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        if impossible is not None and time.monotonic() - asked >= IMPOSSIBLE_EVERY_S:
            asked = time.monotonic()
            why = await impossible()
            if why:
                # Asked after a failed check: one last look, in case it came in between.
                last = await check()
                if last:
                    return last
                raise AssertionError(f"{message}: it cannot happen any more, {why} (after "
                                     f"{time.monotonic() - started:.1f}s of {deadline_s}s; "
                                     f"last seen: {last!r})")
        await asyncio.sleep(interval)
    raise AssertionError(f"{message} (after {deadline_s}s; last seen: {last!r})")


def _never(_: object) -> bool:
    return False


async def retried(call: Callable[[], Awaitable[T]], tries: int, *,
                  on: Callable[[BaseException], bool] = _never,
                  again: Callable[[T], bool] = _never,
                  wait_s: float | Callable[[int, T | None], float] = 0.0) -> T:
    """`call()` up to `tries` times: again after an exception `on` says is worth retrying,
    or a result `again` says is; between tries wait `wait_s` seconds (or
    `wait_s(attempt, result)`: result None after an exception). Anything else ends it at
    once. When the tries are used up, the last outcome stands: its exception is raised, or
    its result returned."""
    def wait(state: RetryCallState) -> float:
        if not callable(wait_s):
            return wait_s
        outcome = state.outcome
        result = outcome.result() if outcome is not None and not outcome.failed else None
        return wait_s(state.attempt_number, result)

    def last_outcome(state: RetryCallState) -> T:
        if state.outcome is None:  # tenacity calls this only after a try
            raise RuntimeError("no try was made")
        result: T = state.outcome.result()  # raises the last exception
        return result

    retrying = AsyncRetrying(stop=stop_after_attempt(tries), wait=wait,
                             retry=retry_if_exception(on) | retry_if_result(again),
                             retry_error_callback=last_outcome)

    async def attempt() -> T:  # a coroutine function: tenacity awaits only those
        return await call()
    found: T = await retrying(attempt)
    return found

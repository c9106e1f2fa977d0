"""Waiting, the one way: poll with a deadline and fail with a message that says what never
happened. Never a bare sleep (STYLE.md).

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

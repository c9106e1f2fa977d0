"""Waiting, the one way: poll with a deadline and fail with a message that says what never
happened. Never a bare sleep (STYLE.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T]], deadline_s: float, message: str,
                     interval: float = 0.05) -> T:
    """Poll until check() returns something truthy; fail with `message` at the deadline."""
    deadline = time.monotonic() + deadline_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"{message} (after {deadline_s}s; last seen: {last!r})")

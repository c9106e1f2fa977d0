"""Shrinking a failing schedule: delta debugging (Zeller's ddmin) over its steps.

Jepsen does not shrink; a schedule of fifty steps that failed once is a poor bug report.
`shrink` keeps removing chunks of steps while the rest still fails, down to a schedule from
which no single step can be removed without the failure going away (1-minimal). Each try is
a real game day, so tries are cached and capped by `max_runs`: when the cap is reached the
smallest failing schedule found so far is returned, and said to be so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Shrunk(Generic[T]):
    items: tuple[T, ...]
    runs: int  # how many candidates were tried (cached ones not counted twice)
    minimal: bool  # False when the run cap stopped the search first


async def shrink(items: Sequence[T], fails: Callable[[tuple[T, ...]], Awaitable[bool]], *,
                 max_runs: int | None = None) -> Shrunk[T]:
    """The smallest subsequence of `items` (order kept) that `fails` still fails on. `items`
    itself is taken to fail (the caller saw it fail)."""
    current = list(range(len(items)))
    seen: dict[tuple[int, ...], bool] = {tuple(current): True}
    runs = 0

    class OutOfRuns(Exception):
        pass

    async def try_(candidate: list[int]) -> bool:
        nonlocal runs
        key = tuple(candidate)
        if key not in seen:
            if max_runs is not None and runs >= max_runs:
                raise OutOfRuns
            runs += 1
            seen[key] = await fails(tuple(items[i] for i in candidate))
        return seen[key]

    n = 2
    try:
        while len(current) >= 2:
            size = len(current) / n
            chunks = [current[round(i * size):round((i + 1) * size)] for i in range(n)]
            chunks = [c for c in chunks if c]
            reduced = False
            for chunk in chunks:  # one chunk alone still fails: keep only it
                if await try_(chunk):
                    current, n, reduced = chunk, 2, True
                    break
            if not reduced:
                for chunk in chunks:  # without one chunk it still fails: drop that chunk
                    rest = [i for i in current if i not in chunk]
                    if len(chunks) > 2 and await try_(rest):
                        current, n, reduced = rest, max(n - 1, 2), True
                        break
            if not reduced:
                if n >= len(current):
                    break
                n = min(n * 2, len(current))
        if len(current) == 1 and await try_([]):
            current = []
    except OutOfRuns:
        return Shrunk(tuple(items[i] for i in current), runs, minimal=False)
    return Shrunk(tuple(items[i] for i in current), runs, minimal=True)

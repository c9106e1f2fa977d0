"""The plane's fixed-cadence loops (covey.app._every: the scheduler's tick, the lease
renewals): a step that fails is logged and the loop goes on; only the loop's own
cancellation ends it."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from covey.app import _every


async def test_a_step_whose_awaited_task_was_cancelled_fails_that_step_only() -> None:
    """The tick awaits its wakes through asyncio.gather. A wake cancelled on its own (a cut
    start's caller) raised CancelledError into the tick, which ended the scheduler's loop:
    no heartbeat, sweep or wake came again."""
    steps = 0
    third = asyncio.Event()

    async def step() -> None:
        nonlocal steps
        steps += 1
        if steps == 1:
            wake = asyncio.ensure_future(asyncio.sleep(3600))
            asyncio.get_running_loop().call_soon(wake.cancel)
            await asyncio.gather(wake)
        if steps == 3:
            third.set()

    with capture_logs() as logs:
        loop = asyncio.create_task(_every(0, "tick", step))
        try:
            await asyncio.wait_for(third.wait(), 10)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    assert loop.cancelled(), "the loop's own cancellation did not end it"
    failed = [e for e in logs if e["event"] == "loop step failed"]
    assert [(e["loop"], e["error"]) for e in failed] == [
        ("tick", "a task it awaited was cancelled")], logs


async def test_the_loops_own_cancellation_during_a_step_ends_it() -> None:
    in_step = asyncio.Event()
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1
        in_step.set()
        await asyncio.gather(asyncio.sleep(3600))  # cancelled through the gather

    loop = asyncio.create_task(_every(0, "tick", step))
    await asyncio.wait_for(in_step.wait(), 10)
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=10)
    assert done and loop.cancelled(), "the plane's shutdown did not end its loop"
    assert steps == 1, f"the loop ran {steps} steps after it was cancelled"


async def test_the_loops_cancellation_turned_into_an_error_by_a_step_still_ends_it() -> None:
    """A step may turn its cancellation into an error of its own on the way out (a
    rollback that fails as the connection is cut): the shutdown must end the loop all the
    same, or the plane's close waits for it for ever."""
    in_step = asyncio.Event()

    async def step() -> None:
        in_step.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("the rollback failed as the connection was cut") from None

    loop = asyncio.create_task(_every(0, "tick", step))
    await asyncio.wait_for(in_step.wait(), 10)
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=10)
    assert done and loop.cancelled(), "a step's error swallowed the plane's shutdown"

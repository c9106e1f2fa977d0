"""The control plane crashed and brought back: SIGKILL (of its process, or its container), then
started again by the stack at the deadline, as an operator's supervisor would restart it.

The stack owns how the control plane starts (its command, port, database, data folder), so the
stack hands the nemesis a `Restartable`; the crash is one standing fault on the one mechanism,
healed at its deadline, by `heal_all` or the halt switch. It has no heal order for a watchdog:
a harness that dies takes its stack, and with it the control plane, down too, so nothing is
left broken for another process to mend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from harness.nemesis.faults import FaultKind, HealFailed
from harness.nemesis.standing import Fault

PLANE = "control plane"


class Restartable(Protocol):
    async def kill(self) -> object: ...

    async def start(self) -> None: ...


class PlaneCrash(Fault):
    kind: FaultKind = "restart"
    key = target = PLANE
    id_prefix = "control-plane"
    heals_last = True

    def __init__(self, plane: Restartable,
                 database_back: Callable[[], Awaitable[None]] | None = None) -> None:
        self.plane = plane
        # A control plane started while its database is away exits on its migrations: at
        # the deadline it waits for a standing database fault to heal first.
        self.database_back = database_back

    async def impose(self) -> str | None:
        await self.plane.kill()
        return None

    async def lift(self) -> str | None:
        try:
            if self.database_back is not None:
                await self.database_back()
            await self.plane.start()
        except (RuntimeError, TimeoutError, OSError) as e:
            raise HealFailed(f"could not start the control plane again: {e}") from e
        return None

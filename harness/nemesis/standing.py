"""The one standing-fault mechanism every kind of fault plugs into.

A fault stands on a target (a proxy, a process, a container, the database) until it heals:
at its deadline, on demand, when a newer fault on the same target replaces it, or by the
halt switch. One fault per target at a time. Each start and heal lands in the log, which the
game day copies into its history and its journal.

A fault that would outlive the harness (a stopped process stays stopped, a paused container
stays paused) gives a heal order: then a detached watchdog carries it out shortly after the
deadline even if the harness is gone, and the fault is listed on disk for `gameday halt`.
A proxy's fault needs no watchdog: the proxy enforces its own deadlines in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.nemesis.faults import FaultKind, FaultRecord, HealedBy, HealFailed
from harness.nemesis.watchdog import FaultRegistry, HealOrder, start_watchdog, stop_watchdog

WATCHDOG_GRACE_S = 0.5  # the watchdog is a backstop: the harness's own timer goes first


class Fault:
    """One kind of fault on one target: how to impose it and how to lift it. Subclasses set
    the fields and override `impose` and `lift`."""

    kind: FaultKind
    key: str  # the target's identity: one standing fault per key
    target: str  # the target as the log names it
    id_prefix: str  # the fault's id is f"{id_prefix}-{kind}-{n}"
    ms: int | None = None
    network: str | None = None
    # Healed after every other fault by `heal_all`: it needs them gone to come back (a
    # control plane cannot start while its database is away).
    heals_last = False

    async def impose(self) -> str | None:
        """Bring the fault about; returns a note when something was odd about it."""
        raise NotImplementedError

    async def lift(self) -> str | None:
        """Undo the fault; returns a note when there was nothing left to undo. Raises
        HealFailed when it cannot be undone."""
        raise NotImplementedError

    def heal_order(self) -> HealOrder | None:
        """How another process heals this fault (see `harness.nemesis.watchdog`); None when
        its heal does not depend on the harness surviving."""
        return None

    def covers(self, standing: Fault) -> bool:
        """Whether this fault, imposed over `standing`, makes lifting that one first pointless
        (a pause over a pause: continuing the process in between would let it run)."""
        return False


@dataclass
class _Standing:
    fault: Fault
    record: FaultRecord
    heals_at: float  # monotonic
    watchdog_pid: int | None = None
    entry: Path | None = None
    timer: asyncio.Task[None] | None = None


class StandingFaults:
    """The standing faults of one owner (a nemesis, a proxy) and their log."""

    def __init__(self, clock: Callable[[], int] = time.time_ns,
                 registry: FaultRegistry | None = None) -> None:
        self._clock = clock
        self._registry = registry
        self._standing: dict[str, _Standing] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._log: list[FaultRecord] = []
        self._ids = itertools.count(1)

    def log(self) -> list[FaultRecord]:
        """Every fault, oldest first, as copies."""
        return [dataclasses.replace(r) for r in self._log]

    def standing(self, key: str) -> FaultRecord | None:
        entry = self._standing.get(key)
        return None if entry is None else dataclasses.replace(entry.record)

    def standing_fault(self, key: str) -> Fault | None:
        entry = self._standing.get(key)
        return None if entry is None else entry.fault

    def keys(self) -> list[str]:
        return list(self._standing)

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def start(self, fault: Fault, deadline_s: float
                    ) -> tuple[FaultRecord, FaultRecord | None]:
        """Replace the standing fault of `fault.key` with `fault`; returns the new record and
        the one it replaced. Raises HealFailed when the standing fault cannot be lifted (it
        then still stands and the new one is not started), and whatever `impose` raises (then
        no fault is left behind)."""
        async with self._lock(fault.key):
            replaced = self._standing.get(fault.key)
            if replaced is not None:
                await self._end(replaced, "replaced", lift=not fault.covers(replaced.fault))
            started_ns = self._clock()
            record = FaultRecord(id=f"{fault.id_prefix}-{fault.kind}-{next(self._ids)}",
                                 target=fault.target, kind=fault.kind, started_ns=started_ns,
                                 deadline_s=deadline_s, ms=fault.ms, network=fault.network,
                                 heals_at_ns=started_ns + round(deadline_s * 1e9))
            entry = _Standing(fault, record, time.monotonic() + deadline_s)
            order = fault.heal_order()
            if order is not None:
                # The watchdog before the fault: a harness dying right after is covered too.
                entry.watchdog_pid, entry.entry = await asyncio.to_thread(
                    self._watch, record, order, entry.heals_at + WATCHDOG_GRACE_S)
            # Logged, and on its timer, before the fault is imposed: were this task cancelled
            # while the imposing runs on in a thread, the fault would still heal.
            self._standing[fault.key] = entry
            self._log.append(record)
            entry.timer = asyncio.create_task(self._heal_at_deadline(entry))
            try:
                note = await fault.impose()
            except BaseException as e:
                self._forget(entry)
                self._log.remove(record)
                if replaced is not None:  # lifted, but replaced by nothing
                    replaced.record.healed_by = "heal"
                    replaced.record.note = f"healed for a {fault.kind} that failed to start: {e}"
                raise
            if note is not None:
                record.note = note
            return (dataclasses.replace(record),
                    None if replaced is None else dataclasses.replace(replaced.record))

    def _watch(self, record: FaultRecord, order: HealOrder, at: float
               ) -> tuple[int, Path | None]:
        entry = None if self._registry is None else self._registry.path_for(record.id)
        pid = start_watchdog(order, at, entry)
        if self._registry is not None:
            self._registry.add(record.id, order, record.heals_at_ns or 0, pid)
        return pid, entry

    def instant(self, fault: Fault) -> FaultRecord:
        """Log a fault that is over once delivered (a kill), after delivering it; the fault
        standing on its target ends with it (`end_for_instant`)."""
        now = self._clock()
        record = FaultRecord(id=f"{fault.id_prefix}-{fault.kind}-{next(self._ids)}",
                             target=fault.target, kind=fault.kind, started_ns=now,
                             healed_ns=now, healed_by="instant")
        self._log.append(record)
        return dataclasses.replace(record)

    async def end_for_instant(self, key: str, *, lift: bool) -> None:
        """End the standing fault of `key` as "replaced" by an instant fault, lifted first if
        `lift` (a disconnect outlives a restart; a pause does not)."""
        async with self._lock(key):
            standing = self._standing.get(key)
            if standing is not None:
                with contextlib.suppress(HealFailed):  # noted; it stands until its deadline
                    await self._end(standing, "replaced", lift=lift)

    async def heal(self, key: str, how: HealedBy = "heal") -> FaultRecord | None:
        """Heal the standing fault of `key` at once; None when there is none. Raises
        HealFailed when it cannot be lifted: the record's note says why, and it stands."""
        async with self._lock(key):
            entry = self._standing.get(key)
            if entry is None:
                return None
            await self._end(entry, how, lift=True)
            return dataclasses.replace(entry.record)

    async def heal_all(self, how: HealedBy = "heal") -> list[FaultRecord]:
        healed = []
        for key in sorted(self._standing, key=lambda k: self._standing[k].fault.heals_last):
            with contextlib.suppress(HealFailed):  # the record says why; verify_healed tells
                record = await self.heal(key, how)
                if record is not None:
                    healed.append(record)
        return healed

    def close(self) -> None:
        """Stop the timers of heals that failed: no retries once the owner is closed (their
        watchdogs still try at the deadline)."""
        for entry in self._standing.values():
            if entry.timer is not None:
                entry.timer.cancel()

    async def _heal_at_deadline(self, entry: _Standing) -> None:
        await asyncio.sleep(max(0.0, entry.heals_at - time.monotonic()))
        async with self._lock(entry.fault.key):
            if self._standing.get(entry.fault.key) is entry:
                with contextlib.suppress(HealFailed):  # noted in the record; it stays unhealed
                    await self._end(entry, "deadline", lift=True)

    async def _end(self, entry: _Standing, how: HealedBy, *, lift: bool) -> None:
        """Lift (if asked) and log the heal. Called with the key's lock held."""
        if lift:
            try:
                note = await entry.fault.lift()
            except HealFailed as e:
                entry.record.note = str(e)
                raise
            if note is not None:
                entry.record.note = note
        entry.record.healed_ns = self._clock()
        entry.record.healed_by = how
        self._forget(entry)

    def _forget(self, entry: _Standing) -> None:
        if self._standing.get(entry.fault.key) is entry:
            del self._standing[entry.fault.key]
        if entry.timer is not None and entry.timer is not asyncio.current_task():
            entry.timer.cancel()
        stop_watchdog(entry.watchdog_pid)
        if entry.entry is not None:
            with contextlib.suppress(OSError):
                entry.entry.unlink()

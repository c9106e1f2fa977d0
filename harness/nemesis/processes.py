"""Process faults: SIGSTOP until the deadline (a group of processes at once, such as a
database server and its backends), and SIGKILL."""

from __future__ import annotations

import os
import signal

import psutil

from harness.nemesis.faults import FaultKind
from harness.nemesis.standing import Fault
from harness.nemesis.watchdog import HealOrder
from harness.stack.waiting import eventually

STOP_WAIT_S = 5.0


# psutil's process statuses as the one letter ps and /proc show (T: stopped).
STATE_LETTERS = {
    psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X", psutil.STATUS_IDLE: "I"}


def process_state(pid: int) -> str | None:
    """The process's state as one letter (T: stopped); None without the process, or where
    psutil cannot tell. A read of procfs never waits on a disk, so this is fine on the event
    loop."""
    try:
        status = psutil.Process(pid).status()
    except (psutil.Error, OSError):
        return None
    return STATE_LETTERS.get(status, status[:1].upper())


async def _stopped(pid: int, within_s: float) -> bool:
    """Whether `pid` is seen stopped within `within_s`: a signal takes effect only when the
    process is next scheduled. Where psutil cannot tell, there is nothing to wait for."""
    async def stopped() -> bool:
        return process_state(pid) in (None, "T", "t")
    try:
        return await eventually(stopped, within_s, f"pid {pid} stopped", interval=0.002)
    except AssertionError:
        return False


class ProcessPause(Fault):
    """SIGSTOP of `pids` (frozen, their sockets open); SIGCONT on heal. `target` names them in
    the log ("pid 123", "postgres")."""

    kind: FaultKind = "pause"

    def __init__(self, pids: list[int], target: str | None = None) -> None:
        self.pids = pids
        self.key = self.target = target or f"pid {pids[0]}"
        self.id_prefix = f"pid{pids[0]}" if target is None else target

    async def impose(self) -> str | None:
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        slow = [pid for pid in self.pids if not await _stopped(pid, STOP_WAIT_S)]
        return (f"not seen stopped within {STOP_WAIT_S:g} s of the SIGSTOP: {slow}"
                if slow else None)

    async def lift(self) -> str | None:
        gone = []
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                gone.append(pid)
        if gone:
            return "the process had exited before it was continued"
        return None

    def heal_order(self) -> HealOrder:
        return {"do": "signal", "pids": self.pids, "signal": "SIGCONT"}

    def covers(self, standing: Fault) -> bool:
        return isinstance(standing, ProcessPause) and set(standing.pids) <= set(self.pids)


class ProcessKill(Fault):
    """SIGKILL: over once delivered."""

    kind: FaultKind = "kill"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.key = self.target = f"pid {pid}"
        self.id_prefix = f"pid{pid}"

"""The harness's own stop switch (AWS FIS's stop, Gremlin's "halt all").

`pull(reason)` heals every standing fault of every harness on this machine at once (from the
on-disk list, so it works from another shell and even when the harness that injected them is
dead), stops every running game day (SIGTERM: each marks its journal `aborted` with the
reason) and leaves a halt standing: no game day starts until `release()`.

Ctrl-C and SIGTERM of a harness take the same way out: the game day is cancelled, its journal
marked `aborted`, and its teardown heals every fault it still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.nemesis.watchdog import FaultRegistry, alive, carry_out, state_dir, stop_watchdog

_signalled: list[str] = []  # the signal that stopped this harness, if one did


@dataclass
class HaltReport:
    reason: str
    healed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # fault id: why its heal failed
    stopped_harnesses: list[int] = field(default_factory=list)


def _halt_file(root: Path | None) -> Path:
    return (root or state_dir()) / "halt.json"


def standing(root: Path | None = None) -> dict[str, Any] | None:
    """The halt that stands ({reason, at, pid}), or None."""
    try:
        halt: dict[str, Any] = json.loads(_halt_file(root).read_text())
    except (OSError, ValueError):
        return None
    return halt


def refusal(root: Path | None = None) -> str | None:
    """Why a new game day may not start, or None when it may."""
    halt = standing(root)
    if halt is None:
        return None
    return (f"A halt stands since {halt['at']} ({halt['reason']}): no game day starts while "
            "it does. Release it with `gameday halt --release` once the stack is safe.")


def pull(reason: str, root: Path | None = None) -> HaltReport:
    """Pull the halt: stand it, heal every listed fault, stop every running game day."""
    path = _halt_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"reason": reason, "pid": os.getpid(),
                                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    report = HaltReport(reason)
    for entry in FaultRegistry(root).entries():
        stop_watchdog(entry.watchdog_pid)  # healed here and now, not at the deadline
        try:
            carry_out(entry.order)
        except Exception as e:  # each failure is reported; none stops the halt
            report.failed[entry.fault_id] = repr(e)
            if alive(entry.owner_pid):
                continue  # its harness may still heal it; keep it listed
        else:
            report.healed.append(entry.fault_id)
        if not entry.fault_id.startswith("proxy-") or not alive(entry.owner_pid):
            with contextlib.suppress(OSError):
                entry.path.unlink()
    for pid in running_game_days(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            report.stopped_harnesses.append(pid)
    return report


def release(root: Path | None = None) -> dict[str, Any] | None:
    """Release the halt; returns the halt that stood (None if none did)."""
    halt = standing(root)
    with contextlib.suppress(FileNotFoundError):
        _halt_file(root).unlink()
    return halt


def _game_days(root: Path | None) -> Path:
    return (root or state_dir()) / "game-days"


def running_game_days(root: Path | None = None) -> list[int]:
    """The pids of harnesses running a game day now (stale entries are dropped)."""
    folder = _game_days(root)
    pids = []
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        pid = int(path.name) if path.name.isdigit() else 0
        if pid and pid != os.getpid() and alive(pid):
            pids.append(pid)
        elif pid != os.getpid():
            with contextlib.suppress(OSError):
                path.unlink()
    return pids


@contextlib.asynccontextmanager
async def game_day_running(root: Path | None = None) -> AsyncIterator[None]:
    """Lists this harness as running a game day (for `pull`) while the block runs."""
    folder = _game_days(root)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(os.getpid())
    path.write_text("")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def stop_on_sigterm() -> None:
    """SIGTERM of the harness stops like Ctrl-C: the running game day is cancelled (asyncio's
    runner does that on SIGINT), so its journal says `aborted` and its teardown heals.

    A harness started with SIGINT ignored (a background job of a script, nohup: the shell
    ignores SIGINT for those, and the children inherit it) would ignore the SIGINT it sends
    itself, and asyncio sets its Ctrl-C handler only over Python's default one: the halt
    did nothing, and every halt and Ctrl-C test failed in a CI run started that way. Such a
    harness takes Python's default back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, _: object) -> None:
        _signalled.append(signal.Signals(signum).name)
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGTERM, on_sigterm)


def abort_reason(exc: BaseException | None, root: Path | None = None) -> str:
    """Why a game day broke off, in words for its journal."""
    halt = standing(root)
    if halt is not None:
        return f"halted: {halt['reason']}"
    if _signalled:
        return f"the harness got {_signalled[-1]}"
    if isinstance(exc, KeyboardInterrupt | asyncio.CancelledError):
        return "interrupted (Ctrl-C)"
    if exc is None:
        return "the game day ended before its scenario wrote a journal"
    return f"the game day broke off: {exc!r}"

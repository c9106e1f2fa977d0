"""What heals a fault when the harness cannot: a detached process per standing fault that
carries out the fault's heal order at its deadline, and the on-disk list of standing faults
that `gameday halt` reads.

A heal order is plain data, so that a process other than the one that injected the fault can
carry it out (the watchdog, or `gameday halt` in another shell):
* `{"do": "signal", "pids": [..], "signal": "SIGCONT"}`
* `{"do": "docker", "action": "unpause" | "start" | "reconnect", "container": ID,
  "network": ID, "reconnect": {..}}`
* `{"do": "http", "method": "DELETE", "url": URL}` (a fault proxy's own control API)
* `{"do": "exec", "argv": [..]}` (a database server started again, say)

The watchdog runs in its own session (neither Ctrl-C nor the harness's death takes it down),
sleeps until the deadline on the monotonic clock (system-wide on Linux), heals, removes the
fault's entry and exits. SIGUSR1 makes it heal at once (the halt switch); SIGTERM makes it
exit without healing (the harness lifted the fault itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HealOrder = dict[str, Any]
STATE_ENV = "COVEY_GAMEDAY_STATE"
EXEC_TIMEOUT_S = 60


STATE_PREFIX = "covey-gameday-"


def state_dir() -> Path:
    """Where this user's halt and standing faults are kept: one folder per user by default,
    so that one person's `gameday halt` neither heals nor blocks another's game days on a
    shared host (`--all-users` reaches every folder)."""
    return Path(os.environ.get(STATE_ENV)
                or Path(tempfile.gettempdir()) / f"{STATE_PREFIX}{os.getuid()}")


def every_users_state_dir() -> list[Path]:
    """This user's state folder and every other user's under the same temporary folder."""
    mine = state_dir()
    others = sorted(p for p in Path(tempfile.gettempdir()).glob(f"{STATE_PREFIX}*")
                    if p.is_dir() and p != mine)
    return [mine, *others]


@dataclass(frozen=True)
class StandingEntry:
    """A standing fault as another process sees it."""

    fault_id: str
    owner_pid: int
    watchdog_pid: int | None
    heals_at_ns: int
    order: HealOrder
    path: Path


class FaultRegistry:
    """One JSON file per standing fault under `state_dir()/faults`."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or state_dir()) / "faults"

    def path_for(self, fault_id: str) -> Path:
        return self.root / f"{os.getpid()}-{_safe(fault_id)}.json"

    def add(self, fault_id: str, order: HealOrder, heals_at_ns: int,
            watchdog_pid: int | None) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path_for(fault_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fault_id": fault_id, "owner_pid": os.getpid(),
                                   "watchdog_pid": watchdog_pid, "heals_at_ns": heals_at_ns,
                                   "order": order}))
        tmp.replace(path)
        return path

    def entries(self) -> list[StandingEntry]:
        found = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                row = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # removed meanwhile, or half written
            found.append(StandingEntry(row["fault_id"], row["owner_pid"], row["watchdog_pid"],
                                       row["heals_at_ns"], row["order"], path))
        return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def carry_out(order: HealOrder) -> str | None:
    """Heal as `order` says (blocking). Returns a note when there was nothing left to heal;
    raises when the heal failed."""
    do = order["do"]
    if do == "signal":
        gone = []
        for pid in order["pids"]:
            try:
                os.kill(pid, signal.Signals[order["signal"]])
            except ProcessLookupError:
                gone.append(pid)
        return f"the process(es) {gone} had exited before the heal" if gone else None
    if do == "docker":
        return _docker(order)
    if do == "http":
        import httpx

        r = httpx.request(order["method"], order["url"], timeout=10)
        if r.status_code >= 400:
            raise RuntimeError(f"{order['method']} {order['url']}: {r.status_code} "
                               f"{r.text[:200]}")
        return None
    if do == "exec":
        done = subprocess.run(order["argv"], capture_output=True, timeout=EXEC_TIMEOUT_S,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(order['argv'])} exited {done.returncode}: "
                               f"{done.stderr.decode(errors='replace')[-300:]}")
        return None
    raise ValueError(f"unknown heal order {order!r}")


def _docker(order: HealOrder) -> str | None:
    import docker

    client = docker.from_env()
    try:
        container = client.containers.get(order["container"])
        action = order["action"]
        if action == "unpause":
            if container.status != "paused":
                return f"no longer paused when healed (status {container.status})"
            container.unpause()
        elif action == "start":
            if container.status in ("running", "paused", "restarting"):
                return f"already started again when healed (status {container.status})"
            container.start()
        elif action == "reconnect":
            networks = (container.attrs.get("NetworkSettings") or {}).get("Networks") or {}
            if any(s.get("NetworkID") == order["network"] for s in networks.values()):
                return "already back on the network when healed"
            client.networks.get(order["network"]).connect(container, **order["reconnect"])
        else:
            raise ValueError(f"unknown docker heal {action!r}")
        return None
    finally:
        client.close()


def start_watchdog(order: HealOrder, at_monotonic: float, entry: Path | None) -> int:
    """Start the detached watchdog of one fault; returns its pid. It is not our child for
    long: the harness does not wait for it (a double fork would hide it from nobody here)."""
    process = subprocess.Popen(
        # By its path, isolated: the watchdog needs the standard library only (and docker or
        # httpx for their orders), not the harness's imports.
        [sys.executable, "-I", __file__, json.dumps(order), repr(at_monotonic),
         str(entry or "")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    _reap_later(process)
    return process.pid


def _reap_later(process: subprocess.Popen[bytes]) -> None:
    # A watchdog that exits must not linger as a zombie of a long harness run.
    threading.Thread(target=process.wait, daemon=True).start()


def stop_watchdog(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    order_text, at_text, entry_text = (argv or sys.argv[1:])[:3]
    order, at = json.loads(order_text), float(at_text)
    now = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: now.set())
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    now.wait(max(0.0, at - time.monotonic()))
    with contextlib.suppress(Exception):  # nobody to tell; the harness's log says unhealed
        carry_out(order)
    if entry_text:
        with contextlib.suppress(OSError):
            Path(entry_text).unlink()


if __name__ == "__main__":
    main()

"""Database faults: Postgres paused (every process of the server frozen, its sockets open) or
restarted (stopped at once, as in a crash, and started again at the deadline), for the
embedded server of the processes stack and the container of the containers stack. The stack
says which it has (`EmbeddedPostgres`, `PostgresContainer`); the nemesis does the rest."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.nemesis.faults import FaultKind, HealFailed
from harness.nemesis.processes import ProcessPause
from harness.nemesis.standing import Fault
from harness.nemesis.watchdog import HealOrder, carry_out

STOP_TIMEOUT_S = 30


@dataclass(frozen=True)
class EmbeddedPostgres:
    """pgserver's server in `pgdata` (run as `system_user` when the harness is root)."""

    pgdata: Path
    system_user: str | None = None

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, walwriter...)."""
        pid_file = self.pgdata / "postmaster.pid"
        postmaster = int(pid_file.read_text().split()[0])
        try:
            children = [c.pid for c in psutil.Process(postmaster).children()]
        except psutil.NoSuchProcess:  # the server is not running: nothing below it
            children = []
        return [postmaster, *children]

    def stop(self) -> None:
        """Stop the server if it runs (blocking): at the end of a stack."""
        if (self.pgdata / "postmaster.pid").exists():
            import pgserver  # type: ignore[attr-defined,unused-ignore]

            with contextlib.suppress(subprocess.SubprocessError):
                pgserver.pg_ctl(  # type: ignore[attr-defined,unused-ignore]
                    ["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.system_user,
                       timeout=STOP_TIMEOUT_S)

    def pause(self) -> ProcessPause:
        return ProcessPause(self.pids(), target="postgres")

    def restart(self) -> EmbeddedRestart:
        return EmbeddedRestart(self)


class EmbeddedRestart(Fault):
    """`pg_ctl stop -m immediate` (no shutdown checkpoint: a crash, as far as clients see),
    then the server started again as pgserver started it."""

    kind: FaultKind = "restart"
    key = target = id_prefix = "postgres"

    def __init__(self, server: EmbeddedPostgres) -> None:
        self.server = server

    async def impose(self) -> str | None:
        import pgserver  # type: ignore[attr-defined,unused-ignore]

        await asyncio.to_thread(pgserver.pg_ctl,  # type: ignore[attr-defined,unused-ignore]
                                ["-w", "-m", "immediate", "stop"],
                                pgdata=self.server.pgdata, user=self.server.system_user,
                                timeout=STOP_TIMEOUT_S)
        return None

    async def lift(self) -> str | None:
        try:
            return await asyncio.to_thread(carry_out, self.heal_order())
        except (RuntimeError, subprocess.SubprocessError) as e:
            raise HealFailed(f"could not start postgres again: {e}") from e

    def heal_order(self) -> HealOrder:
        # pgserver starts an existing data folder's server with the same socket and options;
        # cleanup_mode None: the process that starts it does not stop it on its way out.
        start = ("import sys, pgserver; "
                 "pgserver.get_server(sys.argv[1], cleanup_mode=None)")
        return {"do": "exec", "argv": [sys.executable, "-c", start, str(self.server.pgdata)]}


@dataclass(frozen=True)
class PostgresContainer:
    """The game day's Postgres container, by name."""

    name: str

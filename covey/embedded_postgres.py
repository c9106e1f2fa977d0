"""The embedded Postgres (pgserver) of a data directory: shared by every covey process that
uses it, stopped by the last one to leave.

pgserver shares a server between processes with a list of pids in the data directory that
each process cleans at interpreter exit. A process that never reaches its exit handlers
(SIGKILL, or SIGTERM without a handler) stays on that list for good: with cleanup_mode="stop"
no process after it ever stops the server again, and with None (what covey used) none ever
did, so every `covey` command left a server behind. So covey keeps its own count, one the
kernel keeps honest: every covey process using the server holds a shared flock on
`pgdata.users` for as long as it does, and the kernel drops it when the process ends, however
it ends. Starting and stopping happen under an exclusive flock on `pgdata.lock`: two
processes never start two servers, and one leaving never stops a server another has just
attached to. The one leaving that can turn its shared lock into an exclusive one is the last
user, and stops the server.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Literal

import psutil
import structlog

log = structlog.get_logger(__name__)

TRANSITION_LOCK = "pgdata.lock"  # held exclusively while a server is started or stopped
USERS_LOCK = "pgdata.users"  # held shared by every covey process using the server
LOCK_WAIT_S = 120.0  # a start (initdb included) or a stop by another process takes seconds
READY_WAIT_S = 60.0  # a server found starting (crash recovery after a SIGKILL) gets this long
# Fast shutdown (SIGINT) disconnects clients and checkpoints; if it hangs, immediate
# shutdown (SIGQUIT), then SIGKILL: a server must not outlive the last covey process.
SHUTDOWN_STEPS = ((signal.SIGINT, 60.0), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0))

Leaving = Literal["stopped", "in use", "gone"]


@dataclass(frozen=True)
class EmbeddedPostgres:
    """This process's use of the embedded server of one data directory."""

    data_dir: Path
    pgdata: Path
    url: str
    pid: int  # the postmaster's
    started: bool  # this process started it; else it was running already


@dataclass
class _Use:
    postgres: EmbeddedPostgres
    users_fd: int
    count: int


# One flock per process and data directory: a second open file of the same process would
# count as another user, and the last one to leave would never find itself alone.
_uses: dict[Path, _Use] = {}
_uses_lock = threading.Lock()


def attach(data_dir: Path) -> EmbeddedPostgres:
    """Use the embedded server of data_dir, starting it if none runs. Blocking."""
    pgdata = (data_dir / "pgdata").resolve()
    with _uses_lock:
        use = _uses.get(pgdata)
        if use is not None:
            use.count += 1
            return use.postgres
        data_dir.mkdir(parents=True, exist_ok=True)
        with _signals_held(), _transition(data_dir):
            users_fd = os.open(data_dir / USERS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # Exclusive holds are taken only inside a transition: this never waits.
                fcntl.flock(users_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                postgres = _start_or_reuse(data_dir, pgdata)
            except BaseException:
                # A server this start left half-way, and nobody else uses, goes too.
                _leave(users_fd, pgdata)
                raise
        _uses[pgdata] = _Use(postgres, users_fd, 1)
    if postgres.started:
        log.info("embedded postgres started", pgdata=str(pgdata), pid=postgres.pid)
    else:
        log.info("embedded postgres attached: it was running already", pgdata=str(pgdata),
                 pid=postgres.pid)
    return postgres


def release(postgres: EmbeddedPostgres) -> Leaving:
    """Stop using the server; the last covey process to leave stops it. Blocking."""
    with _uses_lock:
        use = _uses[postgres.pgdata]
        use.count -= 1
        if use.count > 0:
            return "in use"
        del _uses[postgres.pgdata]
        with _signals_held(), _transition(postgres.data_dir):
            outcome, stopped = _leave(use.users_fd, postgres.pgdata)
    if outcome == "stopped":
        log.info("embedded postgres stopped", pgdata=str(postgres.pgdata), pid=stopped)
    elif outcome == "in use":
        log.info("embedded postgres left running: other covey processes use it",
                 pgdata=str(postgres.pgdata), pid=postgres.pid)
    else:
        log.warning("embedded postgres was already gone", pgdata=str(postgres.pgdata),
                    pid=postgres.pid)
    return outcome


@contextmanager
def embedded_postgres(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    postgres = attach(data_dir)
    try:
        yield postgres
    finally:
        release(postgres)


def _start_or_reuse(data_dir: Path, pgdata: Path) -> EmbeddedPostgres:
    running = _wait_until_ready(pgdata)
    from pgserver.postgres_server import PostgresServer

    pgdata.mkdir(exist_ok=True)
    # Not get_server(): it caches a handle per process that still names a server this
    # process stopped; the constructor looks again. cleanup_mode=None: stopping is ours.
    server = PostgresServer(pgdata, cleanup_mode=None)
    pid = server.get_pid()
    if pid is None:
        raise RuntimeError(f"pgserver reports no running server for {pgdata}; "
                           f"see {pgdata / 'log'}")
    return EmbeddedPostgres(data_dir, pgdata, str(server.get_uri()), pid,
                            started=running is None)


def _leave(users_fd: int, pgdata: Path) -> tuple[Leaving, int | None]:
    """Drop this process's hold (inside a transition); stop the server if it was the last.
    Returns the outcome and the pid of the server it stopped."""
    try:
        try:
            fcntl.flock(users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "in use", None
        stopped = _stop(pgdata)
        return ("gone", None) if stopped is None else ("stopped", stopped)
    finally:
        os.close(users_fd)


def _stop(pgdata: Path) -> int | None:
    """Stop the server running on pgdata; its pid, or None if none ran."""
    found = _postmaster(pgdata)
    if found is None:
        return None
    try:
        process = psutil.Process(found[0])
        for signum, grace_s in SHUTDOWN_STEPS:
            process.send_signal(signum)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                # Exited is enough: the server is not our child, and whoever reaps it (init)
                # may take a second or more to do so.
                if process.status() == psutil.STATUS_ZOMBIE:
                    return found[0]
                time.sleep(0.02)
            log.warning("embedded postgres did not stop; trying harder", pgdata=str(pgdata),
                        pid=process.pid, after_s=grace_s)
    except psutil.NoSuchProcess:
        return found[0]
    raise RuntimeError(f"the embedded Postgres of {pgdata} (pid {process.pid}) survived "
                       "SIGKILL")


def _postmaster(pgdata: Path) -> tuple[int, str] | None:
    """(pid, status) of the server running on pgdata, from its postmaster.pid, or None.

    A postmaster.pid whose pid is not a postgres of this directory is stale (a server killed
    outright, its pid since reused): Postgres would refuse to start beside it, or beside the
    socket's lock file of the same server, and pgserver would hand out the address of a dead
    server; so both are removed. Call inside a transition.
    """
    pid_file = pgdata / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except FileNotFoundError:
        return None
    pid = _lock_file_pid(lines)
    if pid is not None and _is_postgres_of(pid, pgdata):
        return pid, lines[7].strip() if len(lines) > 7 else "starting"
    log.warning("removed a stale postmaster.pid: its server is gone", pgdata=str(pgdata),
                pid=pid)
    if len(lines) > 4 and lines[3].strip().isdigit() and lines[4].strip():
        socket_lock = Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}.lock"
        with contextlib.suppress(OSError):
            if _lock_file_pid(socket_lock.read_text().splitlines()) == pid:
                socket_lock.unlink()
    pid_file.unlink(missing_ok=True)
    return None


def _lock_file_pid(lines: list[str]) -> int | None:
    try:
        # Negative: a standalone backend's (initdb's bootstrap, `postgres --single`).
        return abs(int(lines[0]))
    except (IndexError, ValueError):
        return None


def _is_postgres_of(pid: int, pgdata: Path) -> bool:
    try:
        process = psutil.Process(pid)
        return process.name() == "postgres" and str(pgdata) in process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # a process of another user that holds the pid file: not ours to judge


def _wait_until_ready(pgdata: Path) -> int | None:
    """The pid of the running server once it accepts connections, or None if none runs."""
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        found = _postmaster(pgdata)
        if found is None or found[1] == "ready":
            return None if found is None else found[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the embedded Postgres of {pgdata} (pid {found[0]}) is still "
                               f"{found[1]!r} after {READY_WAIT_S:.0f}s; see {pgdata / 'log'}")
        time.sleep(0.1)


@contextmanager
def _transition(data_dir: Path) -> Iterator[None]:
    """The exclusive lock under which a server of data_dir is started or stopped."""
    fd = os.open(data_dir / TRANSITION_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise TimeoutError(
                        f"another covey process (pid {holder}) has been starting or stopping "
                        f"the embedded Postgres of {data_dir} for {LOCK_WAIT_S:.0f}s; "
                        f"if it hangs, stop it") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold stop signals until a start or stop is over, then deliver them: a Ctrl-C in the
    middle of one must not leave a server that no process counts. (Signals reach only the
    main thread; in any other thread there is nothing to hold.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)

    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, hold) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for pending in caught:
            signal.raise_signal(pending)

"""The embedded Postgres does not outlive the `covey` commands that use it: real `covey`
processes, each test on a fresh data directory, stopped the ways users and service managers
stop them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest

from covey.config import ConfigError, Settings
from harness.stack.base import free_port
from harness.stack.waiting import eventually

pytestmark = pytest.mark.slow

ADMIN = ("--org", "acme", "--admin-email", "admin@acme.test", "--admin-password",
         "change-me-now")


def postgres_of(pgdata: Path) -> list[psutil.Process]:
    """Every Postgres process of pgdata: the postmaster names it on its command line, and
    every backend and helper runs with it as its working directory."""
    found = []
    for process in psutil.process_iter(["name", "cmdline", "cwd"]):
        info = process.info
        if info["name"] != "postgres":
            continue
        if info["cwd"] == str(pgdata) or str(pgdata) in (info["cmdline"] or []):
            found.append(process)
    return found


async def none_left(pgdata: Path, what: str) -> None:
    async def gone() -> bool:
        return not postgres_of(pgdata)
    await eventually(gone, 15, f"{what}: Postgres processes of {pgdata} still run")


def postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split()[0])


def events(log: Path, only_covey: bool = True) -> list[str]:
    """The `event` of every JSON log line; with only_covey, every line must be one (at INFO
    the log is covey's own, not its libraries' start-up chatter)."""
    said = []
    for line in log.read_text().splitlines():
        try:
            said.append(json.loads(line)["event"])
        except (json.JSONDecodeError, KeyError, TypeError):
            if only_covey and line.strip():
                raise AssertionError(f"a line of {log} is not covey's own: {line[:300]!r}\n"
                                     f"{log.read_text()[:3000]}") from None
    return said


@dataclass
class Folder:
    data_dir: Path
    logs: Path

    @property
    def pgdata(self) -> Path:
        return (self.data_dir / "pgdata").resolve()

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "COVEY_LOG_LEVEL", "COVEY_DAEMON_COMMAND")}
        return {**env, "COVEY_DATA_DIR": str(self.data_dir), **extra}

    async def run(self, *args: str, **extra: str) -> tuple[int, str, Path]:
        """A short `covey` command: (exit code, stdout, its log)."""
        log = self.logs / f"{args[0]}-{len(list(self.logs.iterdir()))}.log"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "covey", *args, env=self.env(**extra),
                stdout=asyncio.subprocess.PIPE, stderr=err)
            out, _ = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode is not None
        return process.returncode, out.decode(), log

    @asynccontextmanager
    async def serve(self, port: int | None = None) -> AsyncIterator[Serve]:
        port = port or free_port()
        log = self.logs / f"serve-{port}.log"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "covey", "serve", "--port", str(port), env=self.env(),
                stdout=err, stderr=err, start_new_session=True)
        serve = Serve(process, f"http://127.0.0.1:{port}", log)
        try:
            await serve.healthy()
            yield serve
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


@dataclass
class Serve:
    process: asyncio.subprocess.Process
    url: str
    log: Path

    async def healthy(self) -> None:
        async with httpx.AsyncClient(timeout=2) as http:
            async def answers() -> bool:
                if self.process.returncode is not None:
                    raise AssertionError(f"covey serve exited with {self.process.returncode} "
                                         f"during start-up:\n{self.log.read_text()[-3000:]}")
                try:
                    return (await http.get(f"{self.url}/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False
            await eventually(answers, 90, f"covey serve at {self.url} never became healthy")

    async def stop(self, signum: int) -> None:
        self.process.send_signal(signum)
        try:
            await asyncio.wait_for(self.process.wait(), 60)
        except TimeoutError:
            raise AssertionError(f"covey serve did not exit within 60s of signal {signum}:\n"
                                 f"{self.log.read_text()[-3000:]}") from None


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Folder]:
    logs = tmp_path / "logs"
    logs.mkdir()
    # Not under tmp_path: as root, pgserver runs Postgres as its own user, who must traverse
    # every parent folder, and each pytest start resets /tmp/pytest-of-root to 0700 (other
    # runs on this machine would pull the folder from under a running server).
    with tempfile.TemporaryDirectory(prefix="covey-test-embedded-") as data:
        folder = Folder(Path(data) / "data", logs)
        yield folder
        # A failed test must not leave its server to the machine (the test has judged).
        for process in postgres_of(folder.pgdata):
            with contextlib.suppress(psutil.Error):
                process.kill()


async def test_bootstrap_stops_the_postgres_it_started_also_when_it_fails(
        folder: Folder) -> None:
    code, out, log = await folder.run("bootstrap", *ADMIN)
    assert code == 0, f"bootstrap failed:\n{log.read_text()[-3000:]}"
    assert out.strip(), "bootstrap printed no organisation id"
    assert (folder.pgdata / "PG_VERSION").exists(), "bootstrap never used the embedded Postgres"
    await none_left(folder.pgdata, "after covey bootstrap")
    assert events(log).count("embedded postgres started") == 1
    assert "embedded postgres stopped" in events(log)

    # An error (the admin exists with another password) exits non-zero: the same clean-up.
    code, _, log = await folder.run("bootstrap", *ADMIN[:-1], "another-password")
    assert code != 0, "bootstrap with the wrong password for an existing admin succeeded"
    await none_left(folder.pgdata, "after a failed covey bootstrap")
    assert "embedded postgres stopped" in events(log, only_covey=False)


async def test_two_commands_starting_at_once_start_one_server_and_stop_it(
        folder: Folder) -> None:
    (code_a, _, log_a), (code_b, _, log_b) = await asyncio.gather(
        folder.run("migrate"), folder.run("migrate"))
    assert code_a == code_b == 0, f"{log_a.read_text()[-2000:]}\n{log_b.read_text()[-2000:]}"
    said = events(log_a) + events(log_b)
    assert said.count("embedded postgres started") == 1, said
    await none_left(folder.pgdata, "after two covey migrate at once")


async def test_serve_that_cannot_listen_stops_the_postgres_it_started(folder: Folder) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = folder.logs / "serve-taken-port.log"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "covey", "serve", "--port", str(port),
                env=folder.env(), stdout=err, stderr=err, start_new_session=True)
        code = await asyncio.wait_for(process.wait(), 90)
    assert code != 0, "covey serve on a port in use did not fail"
    assert "embedded postgres started" in events(log, only_covey=False), log.read_text()
    await none_left(folder.pgdata, "after covey serve failed to listen")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_serve_stopped_by_a_signal_stops_its_postgres(folder: Folder,
                                                             signum: int) -> None:
    async with folder.serve() as serve:
        assert postgres_of(folder.pgdata), "covey serve answers without an embedded Postgres"
        await serve.stop(signum)
    await none_left(folder.pgdata, f"after covey serve was stopped with {signum!r}")
    said = events(serve.log)
    assert "embedded postgres started" in said, said
    assert "embedded postgres stopped" in said, said


async def test_two_serves_share_one_postgres_and_the_last_one_stops_it(
        folder: Folder) -> None:
    async with folder.serve() as first, folder.serve() as second:
        postmaster = postmaster_pid(folder.pgdata)
        assert "embedded postgres attached: it was running already" in events(second.log)
        await first.stop(signal.SIGTERM)
        assert "embedded postgres left running: other covey processes use it" in \
            events(first.log)
        async with httpx.AsyncClient(timeout=5) as http:
            health = await http.get(f"{second.url}/healthz")
        assert health.status_code == 200, (
            f"the second control plane lost its database when the first stopped: "
            f"{health.status_code} {health.text}")
        assert postmaster_pid(folder.pgdata) == postmaster, "the server was restarted"
        await second.stop(signal.SIGTERM)
    await none_left(folder.pgdata, "after both control planes stopped")
    assert "embedded postgres stopped" in events(second.log)


async def test_serve_after_a_sigkill_reuses_and_stops_the_postgres_left_behind(
        folder: Folder) -> None:
    async with folder.serve() as killed:
        left_behind = postmaster_pid(folder.pgdata)
        await killed.stop(signal.SIGKILL)
    assert psutil.pid_exists(left_behind) and postgres_of(folder.pgdata), \
        "the embedded Postgres did not survive its control plane's SIGKILL (nothing to reuse)"

    async with folder.serve() as serve:
        assert "embedded postgres attached: it was running already" in events(serve.log)
        servers = {p.pid for p in postgres_of(folder.pgdata)
                   if str(folder.pgdata) in p.cmdline()}
        assert servers == {left_behind}, f"a second server was started: {servers}"
        await serve.stop(signal.SIGTERM)
    await none_left(folder.pgdata, "after the control plane that reused the server stopped")
    assert "embedded postgres stopped" in events(serve.log)


async def test_a_server_killed_outright_does_not_block_the_next_start(folder: Folder) -> None:
    async with folder.serve() as killed:
        pids = [p.pid for p in postgres_of(folder.pgdata)]
        for process in postgres_of(folder.pgdata):
            process.kill()
        await killed.stop(signal.SIGKILL)

    async def reaped() -> bool:  # not even a zombie: Postgres would count that as alive
        return not any(psutil.pid_exists(pid) for pid in pids)
    await eventually(reaped, 30, "the killed Postgres processes never went away")
    lines = (folder.pgdata / "postmaster.pid").read_text().splitlines()
    socket_lock = Path(lines[4]) / f".s.PGSQL.{lines[3]}.lock"
    assert socket_lock.exists(), "a server killed outright left no socket lock (nothing to test)"
    # Its pid taken since by another live process of the server's user, as after a reboot:
    # Postgres refuses to start beside lock files naming a live pid it may signal.
    owner = folder.pgdata.stat().st_uid
    stranger = await asyncio.create_subprocess_exec(
        "sleep", "300", user=owner if os.geteuid() == 0 else None)
    try:
        for lock in (folder.pgdata / "postmaster.pid", socket_lock):
            rest = lock.read_text().splitlines()[1:]
            lock.write_text("\n".join([str(stranger.pid), *rest]) + "\n")
        code, _, log = await folder.run("bootstrap", *ADMIN)
    finally:
        stranger.kill()
        await stranger.wait()
    assert code == 0, f"bootstrap beside a stale postmaster.pid failed:\n{log.read_text()}"
    assert "removed a stale postmaster.pid: its server is gone" in events(log)
    await none_left(folder.pgdata, "after the bootstrap that replaced a stale server")


def test_log_level_is_read_in_any_case_and_a_wrong_one_is_named() -> None:
    assert Settings.from_env({"COVEY_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert Settings.from_env({}).log_level == "INFO"
    with pytest.raises(ConfigError, match="COVEY_LOG_LEVEL='loud': use one of debug, info"):
        Settings.from_env({"COVEY_LOG_LEVEL": "loud"})


async def test_debug_brings_back_the_embedded_postgres_own_lines(folder: Folder) -> None:
    code, _, log = await folder.run("migrate", COVEY_LOG_LEVEL="debug")
    assert code == 0, log.read_text()[-3000:]
    assert "Running commandline" in log.read_text(), "pgserver's lines are missing at debug"
    await none_left(folder.pgdata, "after covey migrate at debug")


async def test_a_given_database_url_is_never_started_or_stopped(
        folder: Folder, pg_url: str, database_url: str) -> None:
    code, _, log = await folder.run("bootstrap", *ADMIN, DATABASE_URL=database_url)
    assert code == 0, f"bootstrap failed:\n{log.read_text()[-3000:]}"
    assert not (folder.data_dir / "pgdata").exists(), \
        "covey made an embedded Postgres despite DATABASE_URL"
    conn = await asyncpg.connect(pg_url)  # the user's server still answers
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()

"""Game days against one long-lived deployment (`--stack target`), as a team runs them
before a release: a real `covey serve` started the way the README says (bootstrapped, with
COVEY_MODEL_URL at the harness's puppet port), and the game days as real `pytest` runs in
subprocesses. They must be repeatable, leave the deployment as they found it, and refuse to
start while an emergency stop stands."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from harness.act.client import CoveyClient, json_of
from harness.stack.base import free_port, wait_until_healthy
from harness.stack.isolation import is_game_day_agent
from harness.stack.postgres import create_database, drop_database

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ADMIN = ("admin@acme.test", "change-me-now")
PLATFORM = ("platform@acme.test", "platform-password")
GAME_DAY_TIMEOUT_S = 240


@dataclass
class Deployment:
    url: str
    puppet_port: int
    reports: Path

    def command(self, scenario: str | Path, *, platform: bool = False,
                report_dir: Path | None = None) -> list[str]:
        args = [sys.executable, "-m", "pytest", str(scenario), "-p", "no:cacheprovider",
                "-c", str(ROOT / "pyproject.toml"),
                "--stack", "target", "--target-url", self.url,
                "--target-email", ADMIN[0], "--target-password", ADMIN[1],
                "--puppet-port", str(self.puppet_port), "--agents", "3",
                "--report-dir", str(report_dir or self.reports)]
        if platform:
            args += ["--target-platform-email", PLATFORM[0],
                     "--target-platform-password", PLATFORM[1]]
        return args

    async def admin(self) -> CoveyClient:
        return await CoveyClient.signed_in(self.url, *ADMIN)


@dataclass
class Run:
    code: int
    output: str
    journals: list[dict[str, Any]]


def _journals(report_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(report_dir.glob("*.json"))]


async def run_game_day(command: list[str], report_dir: Path,
                       interrupt_when: str | None = None,
                       on_line: tuple[str, Callable[[], Awaitable[None]]] | None = None) -> Run:
    """One `pytest` of a game day in a subprocess; with `interrupt_when`, Ctrl-C (SIGINT) as
    soon as that line appears in its output; with `on_line`, that action then."""
    child = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("COVEY_TARGET")})
    assert child.stdout is not None
    lines: list[str] = []

    async def read() -> None:
        assert child.stdout is not None
        async for raw in child.stdout:
            line = raw.decode(errors="replace")
            lines.append(line)
            if interrupt_when and interrupt_when in line:
                child.send_signal(signal.SIGINT)
            if on_line and on_line[0] in line:
                await on_line[1]()
    try:
        await asyncio.wait_for(asyncio.gather(read(), child.wait()), GAME_DAY_TIMEOUT_S)
    except TimeoutError:
        child.kill()
        await child.wait()
        raise AssertionError("the game day did not end within "
                             f"{GAME_DAY_TIMEOUT_S} s:\n{''.join(lines)[-4000:]}") from None
    journals = await asyncio.to_thread(_journals, report_dir)
    output = "".join(lines)
    assert len(journals) == 1, f"expected one journal, found {len(journals)}:\n{output[-6000:]}"
    return Run(child.returncode or 0, output, journals)


async def game_days_working(admin: CoveyClient) -> list[str]:
    """Agents of game days in the admin's organisation that are working or have a sandbox
    up."""
    left = []
    for agent in json_of(await admin.agents()):
        if not is_game_day_agent(agent["slug"]):
            continue
        boxes = json_of(await admin.sandboxes(agent["id"]))
        if agent["status"] in ("working", "triggered") or not agent["killed"] or any(
                s["state"] in ("starting", "running") for s in boxes):
            left.append(f"{agent['slug']} ({agent['status']}, killed={agent['killed']})")
    return left


@dataclass
class Served:
    deployment: Deployment
    plane: asyncio.subprocess.Process


@asynccontextmanager
async def serve_deployment(pg_url: str, template_db: str, folder: Path
                           ) -> AsyncIterator[Served]:
    """`covey serve` on its own database, bootstrapped like scripts/serve, with a platform
    admin, and its model at the port where the game days serve the puppet."""
    name = f"covey_target_{uuid.uuid4().hex[:10]}"
    database_url = await create_database(pg_url, name, template_db)
    port, puppet_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COVEY_")},
           "DATABASE_URL": database_url, "COVEY_DATA_DIR": str(folder / "data"),
           "COVEY_MODEL_URL": f"http://127.0.0.1:{puppet_port}/v1", "COVEY_TICK_MS": "300"}
    boot = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "covey", "bootstrap", "--org", "acme", "--admin-email", ADMIN[0],
        "--admin-password", ADMIN[1], "--platform-admin-email", PLATFORM[0],
        "--platform-admin-password", PLATFORM[1], env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await boot.communicate()
    assert boot.returncode == 0, f"covey bootstrap failed: {out.decode()}"
    with (folder / "serve.log").open("ab") as log:
        plane = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "covey", "serve", "--port", str(port), env=env,
            stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_healthy(url, 60, plane)
        yield Served(Deployment(url, puppet_port, folder / "reports"), plane)
    finally:
        await stop_plane(plane)
        await drop_database(pg_url, name)


async def stop_plane(plane: asyncio.subprocess.Process) -> None:
    if plane.returncode is None:
        plane.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(plane.wait(), 30)
        except TimeoutError:
            os.killpg(plane.pid, signal.SIGKILL)
            await plane.wait()


@pytest.fixture(scope="module")
async def deployment(pg_url: str, template_db: str, tmp_path_factory: pytest.TempPathFactory
                     ) -> AsyncIterator[Deployment]:
    async with serve_deployment(pg_url, template_db, tmp_path_factory.mktemp("target")) as s:
        yield s.deployment


@pytest.mark.parametrize("platform", [False, True], ids=["shared-org", "own-orgs"])
async def test_fleet_stop_three_times_on_one_deployment(deployment: Deployment, platform: bool,
                                                        tmp_path: Path) -> None:
    admin = await deployment.admin()
    journals: list[dict[str, Any]] = []
    try:
        for n in range(3):
            reports = tmp_path / f"run-{n}"
            run = await run_game_day(deployment.command(ROOT / "scenarios" / "fleet_stop.py",
                                                        platform=platform, report_dir=reports),
                                     reports)
            assert run.code == 0, f"game day {n + 1} of 3 failed:\n{run.output[-6000:]}"
            (journal,) = run.journals
            journals.append(journal)
            assert journal["status"] == "completed", journal["status"]
            assert journal["rollback"]["complete"], journal["rollback"]
            assert journal["isolation"]["own"] is platform, journal["isolation"]
            if not platform:  # the header and the journal say what the switch will stop
                assert "the fleet switch will stop every agent there" in run.output
                assert "the fleet switch will stop every agent there" in \
                    journal["isolation"]["warning"]
        fleet = json_of(await admin.fleet())
        assert fleet["fleet_killed"] is False, f"the deployment's fleet was left stopped: {fleet}"
        assert await game_days_working(admin) == [], "agents of the game days left working"
        if platform:  # each game day had an organisation of its own
            theirs = {a["id"] for j in journals for a in j["agents"]}
            assert len(theirs) == 9 and len({j["isolation"]["id"] for j in journals}) == 3
            here = {a["id"] for a in json_of(await admin.agents())}
            assert not theirs & here, "game-day agents in the deployment's own organisation"
    finally:
        await admin.aclose()


FAILS_AFTER_THE_KILL = """
import asyncio

from harness.act.client import json_of
from harness.stack.waiting import eventually


async def test_fails_after_the_fleet_kill(gameday):
    day = gameday
    agents = [await day.agent("silent") for _ in range(2)]
    for a in agents:
        await day.task(a["id"])

    async def working():
        tasks = await day.read_tasks()
        return all(t["state"] == "in_progress" for t in tasks.values())
    await eventually(working, 60, "the agents never got to work")
    json_of(await day.operate("security", "kill_fleet", {},
                              day.people["security"].kill_fleet))
    print("fleet killed", flush=True)
    {failure}
"""
FAILURES: dict[str, str] = {
    "failed-assertion": 'assert False, "failed on purpose after the fleet kill"',
    "exception": 'raise RuntimeError("broke on purpose after the fleet kill")',
    # Ctrl-C: the test waits until the harness's runner sends SIGINT.
    "ctrl-c": "await asyncio.Event().wait()",
}


@pytest.mark.parametrize("failure", list(FAILURES))
async def test_rollback_releases_the_switch_a_failed_game_day_pulled(
        deployment: Deployment, failure: str, tmp_path: Path) -> None:
    scenario = tmp_path / "scenarios" / "fails_after_the_kill.py"
    scenario.parent.mkdir()
    scenario.write_text(textwrap.dedent(FAILS_AFTER_THE_KILL).replace(
        "{failure}", FAILURES[failure]))
    reports = tmp_path / "reports"
    command = deployment.command(scenario, report_dir=reports)
    if failure == "ctrl-c":  # uncaptured, so that the runner sees when to press Ctrl-C
        command.append("-s")
    run = await run_game_day(command, reports,
                             interrupt_when="fleet killed" if failure == "ctrl-c" else None)
    assert run.code != 0, f"the game day was meant to fail:\n{run.output[-4000:]}"
    (journal,) = run.journals
    assert journal["status"] == ("failed" if failure == "failed-assertion" else "aborted")
    rollback = journal.get("rollback")
    assert rollback is not None, f"the journal says nothing of a rollback:\n{run.output[-4000:]}"
    assert rollback["complete"], rollback
    released = [line for line in rollback["restored"]
                if line.startswith("released the fleet stop pulled at")]
    assert released, f"the rollback did not say it released the switch: {rollback}"
    assert "by security." in released[0], released
    stopped = [line for line in rollback["restored"] if line.startswith("stopped agent gd-")]
    assert len(stopped) == 2, rollback
    admin = await deployment.admin()
    try:
        fleet = json_of(await admin.fleet())
        assert fleet["fleet_killed"] is False, f"the rollback left the fleet stopped: {fleet}"
        assert await game_days_working(admin) == [], "agents of the game day left working"
    finally:
        await admin.aclose()


async def test_a_game_day_refuses_to_start_while_a_fleet_stop_stands(
        deployment: Deployment, tmp_path: Path) -> None:
    admin = await deployment.admin()
    security_email = f"security.{uuid.uuid4().hex[:6]}@acme.test"
    json_of(await admin.add_member(security_email, "security-password", "security"), 201)
    security = await CoveyClient.signed_in(deployment.url, security_email, "security-password")
    try:
        agents_before = len(json_of(await admin.agents()))
        json_of(await security.kill_fleet())
        pulled_at = datetime.fromisoformat(json_of(await admin.fleet())["fleet_killed_at"])
        reports = tmp_path / "reports"
        started = time.monotonic()
        run = await run_game_day(deployment.command(ROOT / "scenarios" / "fleet_stop.py",
                                                    report_dir=reports), reports)
        took_s = time.monotonic() - started
        assert run.code != 0, f"the game day started under a standing stop:\n{run.output}"
        standing = (f"the fleet stop pulled at {pulled_at:%H:%M:%S} UTC "
                    f"({pulled_at:%Y-%m-%d}) by {security_email} still stands")
        assert standing in run.output, f"no word of the standing stop:\n{run.output[-4000:]}"
        assert "resume it" in run.output and "fresh organisation" in run.output, run.output
        (journal,) = run.journals
        assert journal["status"] == "not_started", journal["status"]
        refused = [p for p in journal["steady_state_hypothesis"] if not p["holds"]]
        assert [p["name"] for p in refused] == ["the fleet is not stopped"], refused
        # At once: no agent made, no two-minute wait for agents that cannot work.
        assert len(json_of(await admin.agents())) == agents_before, "the refused game day " \
            "created agents"
        assert took_s < 60, f"the refusal took {took_s:.1f} s"
        # The stop is someone else's: the rollback left it standing.
        assert json_of(await admin.fleet())["fleet_killed"] is True, "a game day released " \
            "a stop it did not pull"
    finally:
        json_of(await security.resume_fleet())
        await security.aclose()
        await admin.aclose()


async def test_a_rollback_that_cannot_restore_is_a_loud_error(
        pg_url: str, template_db: str, tmp_path: Path) -> None:
    """The deployment goes away after the fleet kill: the rollback cannot release the switch
    and must say so, loudly, naming what is left standing."""
    scenario = tmp_path / "scenarios" / "fails_after_the_kill.py"
    scenario.parent.mkdir()
    gone = tmp_path / "deployment-gone"
    scenario.write_text(textwrap.dedent(FAILS_AFTER_THE_KILL).replace(
        "{failure}", f"await eventually(lambda: asyncio.to_thread(os.path.exists, {str(gone)!r}),"
        " 60, 'the deployment was not stopped')\n    assert False, 'on purpose'").replace(
        "import asyncio", "import asyncio\nimport os"))
    reports = tmp_path / "reports"
    (tmp_path / "target").mkdir()
    async with serve_deployment(pg_url, template_db, tmp_path / "target") as served:
        async def stop_deployment() -> None:
            await stop_plane(served.plane)
            await asyncio.to_thread(gone.touch)
        command = [*served.deployment.command(scenario, report_dir=reports), "-s"]
        run = await run_game_day(command, reports, on_line=("fleet killed", stop_deployment))
    assert run.code != 0
    assert "ERROR at teardown" in run.output, run.output[-4000:]
    assert "could not restore everything; left standing" in run.output, run.output[-4000:]
    assert "the fleet stop this game day pulled may still stand" in run.output, \
        run.output[-4000:]
    (journal,) = run.journals
    assert journal["rollback"]["complete"] is False, journal["rollback"]
    assert any("may still stand" in line for line in journal["rollback"]["could_not"])


async def test_a_game_day_refuses_to_start_when_the_deployment_cannot_reach_the_puppet(
        deployment: Deployment, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    elsewhere = Deployment(deployment.url, free_port(), deployment.reports)  # not its model
    run = await run_game_day(elsewhere.command(ROOT / "scenarios" / "fleet_stop.py",
                                               report_dir=reports), reports)
    assert run.code != 0, f"the game day started without a reachable puppet:\n{run.output}"
    assert "(steady-state hypothesis: the puppet model is reachable from the deployment)" \
        in run.output, run.output[-4000:]
    assert "no model request of the probe agent reached the puppet" in run.output, \
        run.output[-4000:]
    assert f"COVEY_MODEL_URL=http://127.0.0.1:{elsewhere.puppet_port}/v1" in run.output, \
        run.output[-4000:]
    (journal,) = run.journals
    assert journal["status"] == "not_started", journal["status"]
    assert [p["holds"] for p in journal["steady_state_hypothesis"]] == [True, True, False]
    assert journal["rollback"]["complete"], journal["rollback"]
    admin = await deployment.admin()
    try:
        assert await game_days_working(admin) == [], "the probe agent was left working"
    finally:
        await admin.aclose()

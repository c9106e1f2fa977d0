"""The standing-fault mechanism and the harness's halt switch, with real processes: a fault
that fails to start leaves nothing behind, a SIGKILLed harness leaves no fault standing past
its deadline, `gameday halt` heals everything at once, stops a running game day (its journal
says aborted, and why) and refuses new ones until released."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from harness.nemesis import Nemesis, halt, watchdog
from harness.nemesis.watchdog import STATE_ENV, FaultRegistry
from harness.run.cli import app
from harness.stack.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 3.0
# The watchdog's grace (0.5 s) plus a loaded 2-core machine's slack.
HEALED_WITHIN_S = DEADLINE_S + 10

# A harness that injects two faults that would outlive it (a process pause, and a blackhole
# on a proxy run on its own), says so, and waits to be killed.
HARNESS = """
import asyncio, json, sys
from pathlib import Path
from harness.nemesis import Nemesis, RemoteFaultProxy, halt
from harness.nemesis.watchdog import FaultRegistry
from harness.stack.base import proxy_process

async def main(pid, deadline, root):
    halt.stop_on_sigterm()
    registry = FaultRegistry(Path(root))
    async with halt.game_day_running(Path(root)), Nemesis(registry=registry) as nemesis, \\
            proxy_process("link", 9, Path(root)) as proxy:
        await nemesis.add_remote(proxy)
        pause = await nemesis.pause_process(pid, deadline)
        cut = await proxy.blackhole(deadline)
        print(json.dumps({"pause": pause.id, "cut": cut.id, "control": proxy.control_url}),
              flush=True)
        await asyncio.sleep(3600)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
"""


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@pytest.fixture
async def sleeper() -> AsyncIterator[asyncio.subprocess.Process]:
    child = await asyncio.create_subprocess_exec("sleep", "300")
    yield child
    if child.returncode is None:
        child.kill()
        await child.wait()


def ignoring_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def start_harness(sleeper: int, deadline_s: float, root: Path,
                        ctrl_c_ignored: bool = False
                        ) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """`ctrl_c_ignored`: started as a background job of a script is (SIGINT ignored)."""
    harness = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HARNESS, str(sleeper), str(deadline_s), str(root), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, STATE_ENV: str(root)},
        preexec_fn=ignoring_ctrl_c if ctrl_c_ignored else None)
    assert harness.stdout is not None
    line = await asyncio.wait_for(harness.stdout.readline(), 60)
    assert line, "the harness died before injecting its faults"
    return harness, json.loads(line)


async def proxy_fault(control: str) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=5) as http:
        state: dict[str, object] = (await http.get(f"{control}/faults")).json()
    return state


async def test_a_fault_that_fails_to_start_leaves_nothing_standing(tmp_path: Path) -> None:
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()
    async with Nemesis(registry=FaultRegistry(tmp_path)) as nemesis:
        with pytest.raises(ProcessLookupError):
            await nemesis.pause_process(gone.pid, DEADLINE_S)
        assert nemesis.faults() == [], "a pause that never started is in the fault log"
        assert FaultRegistry(tmp_path).entries() == [], (
            "a pause that never started is listed as standing: a halt would try to heal it")


async def test_a_sigkilled_harness_leaves_no_fault_standing_past_its_deadline(
        sleeper: asyncio.subprocess.Process, tmp_path: Path) -> None:
    harness, faults = await start_harness(sleeper.pid, DEADLINE_S, tmp_path)
    killed_at = time.monotonic()
    harness.kill()  # SIGKILL: no heal, no clean-up, no timer of the harness survives
    await harness.wait()
    assert process_state(sleeper.pid) == "T", "the pause did not hold once the harness died"

    async def everything_healed() -> bool:
        if process_state(sleeper.pid) == "T":
            return False
        try:
            state = await proxy_fault(faults["control"])
        except httpx.ConnectError:
            return True  # the proxy healed and went once its harness was gone
        return state["active"] is None
    await eventually(everything_healed, HEALED_WITHIN_S, "a fault of the SIGKILLed harness "
                     "was still standing past its deadline")
    assert time.monotonic() - killed_at >= DEADLINE_S - 1, (
        "the pause ended before its deadline: the watchdog must wait for it")

    async def unlisted() -> bool:
        return not [e for e in FaultRegistry(tmp_path).entries()
                    if e.fault_id == faults["pause"]]
    await eventually(unlisted, 10, "the healed pause is still listed as standing")


@pytest.mark.parametrize("ctrl_c_ignored", [False, True], ids=["a shell", "a background job"])
async def test_the_halt_heals_every_fault_at_once_and_stops_the_game_day(
        sleeper: asyncio.subprocess.Process, tmp_path: Path, ctrl_c_ignored: bool) -> None:
    harness, faults = await start_harness(sleeper.pid, 300, tmp_path, ctrl_c_ignored)
    try:
        pulled = halt.pull("drill: halt all", tmp_path)
        assert faults["pause"] in pulled.healed, f"the halt did not heal the pause: {pulled}"
        assert pulled.stopped_harnesses == [harness.pid], (
            f"the halt did not stop the running game day: {pulled}")
        assert process_state(sleeper.pid) != "T", "the paused process is still stopped"
        # Healed through the proxy's own API (its DELETE answered), before the harness went.
        assert "proxy-link" in pulled.healed, f"the halt did not heal the proxy: {pulled}"
        assert await asyncio.wait_for(harness.wait(), 60) != 0, "the harness ignored the halt"
        assert halt.refusal(tmp_path) is not None, "no halt stands after pulling it"
    finally:
        if harness.returncode is None:
            harness.kill()
            await harness.wait()
    assert halt.release(tmp_path) is not None and halt.refusal(tmp_path) is None, (
        "the halt could not be released")


def test_gameday_run_refuses_while_a_halt_stands(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_ENV, str(tmp_path))
    cli = CliRunner()
    pulled = cli.invoke(app, ["halt", "--reason", "stack unsafe"])
    assert pulled.exit_code == 0, pulled.output
    refused = cli.invoke(app, ["run", "scenarios/fleet_stop.py"])
    assert refused.exit_code == 2 and "stack unsafe" in refused.output, (
        f"a game day started while a halt stood: {refused.output}")
    released = cli.invoke(app, ["halt", "--release"])
    assert released.exit_code == 0 and "released" in released.output, released.output
    assert halt.refusal(tmp_path) is None, "the halt still stands after its release"


def test_a_halt_is_one_users_unless_all_users_are_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another user's game days on the same host keep running through my halt.
    monkeypatch.delenv(STATE_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = tmp_path / "covey-gameday-4242"
    other.mkdir()
    mine = watchdog.state_dir()
    assert mine == tmp_path / f"covey-gameday-{os.getuid()}", mine
    cli = CliRunner()
    assert cli.invoke(app, ["halt", "--reason", "mine only"]).exit_code == 0
    assert halt.refusal(mine) is not None, "my halt does not stand"
    assert halt.refusal(other) is None, "my halt stopped another user's game days"
    assert cli.invoke(app, ["halt", "--release"]).exit_code == 0
    pulled = cli.invoke(app, ["halt", "--all-users", "--reason", "everyone"])
    assert pulled.exit_code == 0, pulled.output
    assert halt.refusal(mine) is not None and halt.refusal(other) is not None, (
        f"--all-users did not halt every user's game days: {pulled.output}")
    assert cli.invoke(app, ["halt", "--release", "--all-users"]).exit_code == 0
    assert halt.refusal(mine) is None and halt.refusal(other) is None


SCENARIO = """
import os
from harness.record.gameday import GameDay

async def test_waits_under_a_fault(gameday: GameDay) -> None:
    await gameday.endpoints.nemesis.pause_process(int(os.environ["SLEEPER"]), 600)
    await gameday.until.condition(lambda: _never(), 600, "the halt never came")

async def _never() -> bool:
    return False
"""


# A whole game day on a processes stack, in a pytest of its own: the full run's (scripts/test).
@pytest.mark.slow
async def test_a_halted_game_day_journal_says_aborted_and_why(
        sleeper: asyncio.subprocess.Process, tmp_path: Path) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "under_a_fault.py").write_text(SCENARIO)
    state, reports = tmp_path / "state", tmp_path / "reports"
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", str(folder / "under_a_fault.py"), "--stack",
        "processes", "--report-dir", str(reports), "-p", "no:cacheprovider", "-q",
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), cwd=ROOT,
        env={**os.environ, STATE_ENV: str(state), "SLEEPER": str(sleeper.pid)},
        stdout=(tmp_path / "run.log").open("wb"), stderr=asyncio.subprocess.STDOUT)
    try:
        async def paused() -> bool:
            return process_state(sleeper.pid) == "T"
        await eventually(paused, 300, "the game day never paused the process",
                         impossible=lambda: _exited(run, tmp_path / "run.log"))
        pulled = halt.pull("drill: the stack looks wrong", state)
        assert pulled.stopped_harnesses == [run.pid], f"the game day was not stopped: {pulled}"
        assert process_state(sleeper.pid) != "T", "the halt left the process paused"
        assert await asyncio.wait_for(run.wait(), 120) != 0, "the halted game day passed"
    finally:
        if run.returncode is None:
            run.send_signal(signal.SIGKILL)
            await run.wait()
        halt.release(state)
    [journal] = list(reports.glob("test_waits_under_a_fault-*[0-9]Z.json"))
    document = json.loads(journal.read_text())
    assert document["status"] == "aborted", f"a halted game day's journal says {document}"
    assert document["aborted_reason"] == "halted: drill: the stack looks wrong", (
        f"the journal does not say why the game day was aborted: {document['aborted_reason']}")


async def _exited(run: asyncio.subprocess.Process, log: Path) -> str | None:
    if run.returncode is None:
        return None
    output = await asyncio.to_thread(log.read_text)
    return f"the game day exited {run.returncode}: {output[-2000:]}"

"""The generator: a seed gives one schedule, a journal's schedule replays the same
operations, and shrinking finds the two steps that make a planted checker fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from harness.act.client import CoveyClient
from harness.generator import faults as fault_registry
from harness.generator import random_day
from harness.generator.play import Played, apply
from harness.generator.random_day import RandomDay
from harness.generator.schedule import (
    ALLOWED,
    OPERATIONS,
    ROLES,
    AgentPlan,
    Schedule,
    Step,
    from_journal,
    generate,
    write,
)
from harness.generator.shrink import shrink
from harness.judge.checkers import FinalState, Verdict
from harness.record.gameday import GameDay
from harness.record.history import History

FAULT_NAMES = sorted(fault_registry.FAULTS)
OUTAGE_FAULTS = {"pause_database", "restart_database", "crash_control_plane",
                 "crash_control_plane_mid_fleet_kill", "kill_sandbox", "partition_replica"}


def test_a_seed_gives_one_schedule_and_another_seed_another() -> None:
    one = generate(42, agents=5, duration_s=60, faults=FAULT_NAMES)
    assert one == generate(42, agents=5, duration_s=60, faults=FAULT_NAMES)
    assert one != generate(43, agents=5, duration_s=60, faults=FAULT_NAMES)
    assert len(one.agents) == 5 and 30 <= len(one.steps) <= 120
    assert all(0 < s.at_s < 60 for s in one.steps)
    assert [s.at_s for s in one.steps] == sorted(s.at_s for s in one.steps)
    kinds = {s.name for s in one.steps}
    assert set(OPERATIONS) <= kinds, f"a minute-long schedule misses {set(OPERATIONS) - kinds}"
    assert {s.name for s in one.steps if s.kind == "fault"} <= set(FAULT_NAMES)
    # Mostly people allowed to act; a refusal now and then.
    allowed = [s.role in ALLOWED[s.name] for s in one.steps if s.kind == "operation"]
    assert 0.7 < sum(allowed) / len(allowed) < 1


def test_a_schedule_is_plain_data_and_round_trips() -> None:
    schedule = generate(7, agents=3, duration_s=20, faults=FAULT_NAMES)
    text = json.dumps(schedule.to_json())
    assert Schedule.from_json(json.loads(text)) == schedule


def test_no_fault_is_drawn_where_the_stack_offers_none() -> None:
    schedule = generate(7, agents=3, duration_s=60, faults=[])
    assert all(s.kind == "operation" for s in schedule.steps)


def test_a_schedule_naming_an_agent_it_lacks_is_refused() -> None:
    data = generate(7, agents=2, duration_s=10).to_json()
    data["steps"][0]["agent"] = 5
    with pytest.raises(ValueError, match="names agent #5"):
        Schedule.from_json(data)


def _answer(request: httpx.Request) -> httpx.Response:
    """The control plane, as a table: a backlog of three tasks, and yes to everything else."""
    if request.method == "GET" and request.url.path.endswith("/backlog"):
        agent = request.url.path.split("/")[-2]
        return httpx.Response(200, json=[{"id": f"{agent}-t{n}", "created_at": str(n)}
                                         for n in range(3)])
    return httpx.Response(200, json={})


def _day(tmp_path: Path, answer: Callable[[httpx.Request], httpx.Response] = _answer
         ) -> GameDay:
    """A game day whose people talk to `answer`: the player's calls go through the real
    recording client, and only the control plane is a table."""
    day = GameDay(name="replay", stack="none", endpoints=None,  # type: ignore[arg-type]
                  seed=1, report_dir=tmp_path)
    for role in ROLES:
        client = CoveyClient("http://covey.test")
        client.http = httpx.AsyncClient(base_url="http://covey.test",
                                        transport=httpx.MockTransport(answer))
        day.people[role] = client
    return day


async def _played(schedule: Schedule, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> list[tuple[Any, ...]]:
    """The operations a schedule's steps make, as the history records them."""
    day = _day(tmp_path)
    for name, entry in fault_registry.FAULTS.items():
        async def fault(d: Any, params: dict[str, Any], name: str = name) -> dict[str, Any]:
            return {"id": name}
        monkeypatch.setitem(fault_registry.FAULTS, name,
                            fault_registry.FaultAction(fault, entry.draw, entry.needs_agent,
                                                       entry.usable))
    agents = [{"id": f"agent-{n}", "trigger_token": f"token-{n}"}
              for n in range(len(schedule.agents))]
    played = Played()
    for index, step in enumerate(schedule.steps):
        await apply(day, agents, index, step, played)
    await day.close()
    assert played.operations + played.faults == len(schedule.steps)
    ignored = ("title",)  # made up by the game day's faker, not by the schedule
    return [(op.f, op.process, op.type,
             sorted((k, v) for k, v in op.value.items() if k not in ignored))
            for op in day.history.operations() if op.f not in ("step", "task_state")]


async def test_replaying_a_journals_schedule_makes_the_same_operations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = generate(2026, agents=4, duration_s=30, faults=FAULT_NAMES)
    journal = tmp_path / "random_gameday.json"
    journal.write_text(json.dumps({"status": "failed", "schedule": schedule.to_json()}))
    replayed = from_journal(journal)
    assert replayed == schedule
    first = await _played(schedule, tmp_path, monkeypatch)
    again = await _played(replayed, tmp_path, monkeypatch)
    assert first == again and len(first) == len(schedule.steps)
    assert {f for f, *_ in first} >= {"kill_agent", "kill_fleet", "wake", "fault"}
    # A shrunk schedule's own file replays the same way.
    assert from_journal(write(schedule, tmp_path / "shrunk.schedule.json")) == schedule


def test_a_journal_without_a_schedule_says_so(tmp_path: Path) -> None:
    journal = tmp_path / "fleet_stop.json"
    journal.write_text(json.dumps({"status": "completed"}))
    with pytest.raises(ValueError, match="holds no schedule"):
        from_journal(journal)


# ---------------------------------------------------------------- shrinking


def kill_then_wake(history: History, final: FinalState) -> Verdict:
    """The planted checker: fails when a fleet kill is followed by a wake."""
    ops = [op.f for op in history.operations() if op.process.startswith("operator:")]
    kills = [i for i, f in enumerate(ops) if f == "kill_fleet"]
    wakes = [i for i, f in enumerate(ops) if f == "wake"]
    failing = bool(kills and wakes and min(kills) < max(wakes))
    return Verdict("kill_then_wake", not failing, "a wake came after the fleet kill")


def _history_of(steps: tuple[Step, ...]) -> History:
    history = History()
    for step in steps:
        invoke = history.invoke(f"operator:{step.role}", step.name, {"agent": step.agent})
        history.complete(invoke, "ok", {"status": 200})
    return history


async def test_shrinking_finds_exactly_the_two_steps_that_fail() -> None:
    filler = [n for n in OPERATIONS if n not in ("kill_fleet", "wake")]
    steps = [Step(float(i), "operation", filler[i % len(filler)], "org_admin", i % 3)
             for i in range(40)]
    steps[3] = Step(3.0, "operation", "wake", "org_admin", 1)  # before the kill: harmless
    steps[7] = kill = Step(7.0, "operation", "kill_fleet", "security")
    steps[31] = wake = Step(31.0, "operation", "wake", "agent_owner", 2)
    schedule = Schedule(seed=1, duration_s=40, agents=(AgentPlan("silent"),) * 3,
                        steps=tuple(steps))

    async def fails(candidate: tuple[Step, ...]) -> bool:
        return kill_then_wake(_history_of(candidate), FinalState()).valid is False

    assert await fails(schedule.steps)
    shrunk = await shrink(schedule.steps, fails)
    assert shrunk.items == (kill, wake) and shrunk.minimal
    assert shrunk.runs < 60, f"ddmin took {shrunk.runs} tries for 40 steps"


async def test_shrinking_stops_at_its_run_cap_with_a_failing_schedule() -> None:
    steps = tuple(range(64))

    async def fails(candidate: tuple[int, ...]) -> bool:
        return 10 in candidate and 50 in candidate

    shrunk = await shrink(steps, fails, max_runs=8)
    assert shrunk.runs == 8 and not shrunk.minimal
    # Halves, then quarters, then all but one quarter: the eighth try dropped 16 steps.
    assert await fails(shrunk.items) and len(shrunk.items) == 48


async def test_a_broken_random_day_is_shrunk_and_says_how_to_replay_both(
        tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule it broke, the replay of its seed, and a shrunk schedule written beside the
    journals with its own replay; a try that breaks another rule does not count as failing."""
    kill = Step(2.0, "operation", "kill_fleet", "security")
    steps = tuple(Step(float(i), "operation", "wake", "org_admin", 0) for i in range(6))
    schedule = Schedule(seed=9, duration_s=8, agents=(AgentPlan("silent"),),
                        steps=(*steps[:2], kill, *steps[2:]))
    day = GameDay(name="test_random_gameday[seed9]", stack="processes",
                  endpoints=None,  # type: ignore[arg-type]
                  seed=9, report_dir=tmp_path, required=("no_task_lost",))

    async def verdicts_of(like: GameDay, tried: Schedule) -> list[Verdict]:
        assert like is day
        if kill in tried.steps:
            return [Verdict("no_task_lost", False, "a task was lost")]
        return [Verdict("no_task_lost", True, "no task lost"),
                Verdict("none_done_twice", False, "another rule")]
    monkeypatch.setattr(random_day, "verdicts_of", verdicts_of)
    monkeypatch.setattr(request.config.option, "shrink_runs", 20)

    broken = await RandomDay(day, request.config, "scenarios/random_gameday.py", schedule,
                             None).broken([Verdict("no_task_lost", False, "a task was lost")])
    assert broken[0] == "no_task_lost: a task was lost (events none)", broken
    assert broken[1] == ("replay: pytest scenarios/random_gameday.py --stack processes "
                         "--seed 9 --schedules 1 --agents 1 --duration 8")
    assert broken[2].startswith("shrunk in ") and "from 7 to 1 steps: " in broken[2], broken
    shrunk = from_journal(str(broken[3].rsplit("--replay ", 1)[1]))
    assert shrunk.steps == (kill,), shrunk
    assert await RandomDay(day, request.config, "scenarios/random_gameday.py", schedule,
                           None).broken([Verdict("no_task_lost", True, "held")]) == []


# ---------------------------------------------------------------- outages


def test_the_outage_faults_are_drawn_from_the_seed_alone() -> None:
    """The database and control-plane faults are drawn like the others: the same seed gives
    the same steps with the same deadlines, and a long schedule draws each of them."""
    one = generate(11, agents=4, duration_s=600, faults=FAULT_NAMES)
    assert one == generate(11, agents=4, duration_s=600, faults=FAULT_NAMES)
    drawn = {s.name for s in one.steps if s.kind == "fault"}
    assert OUTAGE_FAULTS <= drawn, f"ten minutes drew none of {OUTAGE_FAULTS - drawn}"
    for step in one.steps:
        if step.name in OUTAGE_FAULTS - {"kill_sandbox"}:
            assert 1.0 <= step.params["deadline_s"] <= 5.0, step  # each heals at a deadline
    text = json.dumps(one.to_json())
    assert Schedule.from_json(json.loads(text)) == one


def _stack(name: str, *, database: object | None, plane: object | None) -> Any:
    nemesis = SimpleNamespace(database=database, proxies={})
    # A stack that runs its control plane can start a second replica of it.
    return SimpleNamespace(stack=name, endpoints=SimpleNamespace(
        nemesis=nemesis, control_plane=plane, replica=None if plane is None else object()))


def test_outage_faults_are_offered_only_where_the_stack_runs_the_part() -> None:
    """The processes and containers stacks run their database and control plane (and can
    start a second replica): all can be faulted. A target deployment's are not the harness's
    to restart."""
    here = fault_registry.usable_faults(_stack("processes", database=object(),
                                                plane=object()))
    assert OUTAGE_FAULTS <= set(here)
    target = fault_registry.usable_faults(_stack("target", database=None, plane=None))
    assert not OUTAGE_FAULTS & set(target), sorted(OUTAGE_FAULTS & set(target))


def _database_away(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"error": "Database unreachable", "hint": "retry it"})


def _plane_down(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("All connection attempts failed", request=request)


@pytest.mark.parametrize(("answer", "outcome"), [(_database_away, "info"),
                                                 (_plane_down, "fail")],
                         ids=["database-away", "plane-down"])
async def test_the_player_rides_out_an_outage_and_records_it_as_jepsen_does(
        tmp_path: Path, answer: Callable[[httpx.Request], httpx.Response],
        outcome: str) -> None:
    """During an outage every step is still played and recorded: an operation the database
    could not record is `info` (a kill may have been recorded in part), one that never
    reached the control plane is `fail`; the reads of tasks around a kill are failed reads.
    Nothing ends the schedule."""
    schedule = generate(2026, agents=3, duration_s=20)  # operations only
    day = _day(tmp_path, answer)
    agents = [{"id": f"agent-{n}", "trigger_token": f"token-{n}"} for n in range(3)]
    day.agents.update({a["id"]: a for a in agents})
    played = Played()
    for index, step in enumerate(schedule.steps):
        await apply(day, agents, index, step, played)
    await day.close()
    operations = [op for op in day.history.operations()
                  if op.process.startswith("operator:")]
    changes = sum(1 for s in schedule.steps if s.name == "change_task")
    assert len(operations) == len(schedule.steps) - changes  # a change needs a task read
    assert {op.type for op in operations} == {outcome}, sorted({op.type for op in operations})
    kills = [s for s in schedule.steps if s.name in ("kill_agent", "kill_fleet")]
    reads = [op for op in day.history.operations("read") if op.type == "fail"]
    assert kills and len(reads) >= len(kills) + changes
    assert played.outage_answers >= len(operations)

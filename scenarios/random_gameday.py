"""Random game days: a seeded schedule of operations by the game day's people (kills,
resumes, new tasks, triggers, heartbeat fires, wakes, task changes) interleaved with faults,
over agents of mixed behaviours; the incident then ends, and the checkers judge the history.

    pytest scenarios/random_gameday.py --stack processes [--schedules 2] [--duration 15]
    pytest scenarios/random_gameday.py --seed N --schedules 1   # replays schedule N
    pytest scenarios/random_gameday.py --replay reports/JOURNAL.json
    pytest scenarios/random_gameday.py --schedules 50 --duration 60   # the soak

A failing schedule is shrunk (`--shrink-runs` game days at most) to a minimal one that still
fails, written beside the journals, and the failure says how to replay both.
"""

from __future__ import annotations

import re

import pytest

from harness.checkers import FinalState, Verdict
from harness.gameday import GameDay
from harness.generator.faults import usable_faults
from harness.generator.play import play, verdicts_of
from harness.generator.schedule import Schedule, Step, from_journal, generate, write
from harness.generator.shrink import shrink
from harness.plugin import run_seed
from harness.switch_checkers import task_fates
from harness.verdicts import broken_rules, failed

CHECKED = ("no_action_after_kill_ack", "in_progress_requeued", "no_wake_of_stopped_agent",
           "every_fault_healed", "no_task_lost", "none_done_twice",
           "kill_confirmed_within_lease", "no_sandbox_alive_after_stop",
           "fleet_resume_keeps_own_kills", "wake_paths_refused_while_stopped")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per schedule: seeds --seed, --seed+1, ... so that `--seed S --schedules 1`
    replays the schedule of seed S; or the one schedule of --replay."""
    if "schedule_seed" not in metafunc.fixturenames:
        return
    config = metafunc.config
    replay = config.getoption("--replay")
    if replay:
        try:
            from_journal(replay)  # a file that cannot be replayed fails before a stack is up
        except (OSError, ValueError, KeyError, TypeError) as bad:
            raise pytest.UsageError(f"--replay {replay}: {bad}") from bad
        metafunc.parametrize("schedule_seed", [None], ids=["replay"])
        return
    count: int = config.getoption("--schedules")
    if count < 1:
        raise pytest.UsageError("--schedules must be at least 1")
    seeds = [run_seed(config) + i for i in range(count)]
    metafunc.parametrize("schedule_seed", seeds, ids=[f"seed{s}" for s in seeds])


def replay_command(config: pytest.Config, day: GameDay, schedule: Schedule,
                   replay: str | None = None) -> str:
    how = (f"--replay {replay}" if replay else
           f"--seed {schedule.seed} --schedules 1 --agents {len(schedule.agents)} "
           f"--duration {schedule.duration_s:g}")
    return f"pytest scenarios/random_gameday.py --stack {day.stack} {how}"


def figures(day: GameDay, verdicts: list[Verdict], final: FinalState) -> dict[str, int]:
    """The soak's counts for this schedule (benchmarks/soak.py adds them up)."""
    lost, _ = task_fates(final)
    late = next((v for v in verdicts if v.checker == "no_action_after_kill_ack"
                 and v.valid is False), None)
    return {"tasks": len(final.tasks), "lost_tasks": len(lost),
            "done_twice": sum(1 for t in final.tasks.values() if t["done_count"] > 1),
            "actions_after_kill_ack": 0 if late is None else sum(
                1 for i in late.evidence if day.history[i].f == "action")}


# in_progress_requeued may stay undecided: a schedule need not kill a working agent.
@pytest.mark.checkers(*CHECKED)
@pytest.mark.decides("no_task_lost", "none_done_twice", "every_fault_healed")
async def test_random_gameday(gameday: GameDay, agents_per_game_day: int,
                              schedule_seed: int | None, request: pytest.FixtureRequest) -> None:
    day, config = gameday, request.config
    replay: str | None = config.getoption("--replay")
    schedule = (from_journal(replay) if replay else
                generate(int(schedule_seed or 0), agents=agents_per_game_day,
                         duration_s=config.getoption("--duration"),
                         faults=usable_faults(day)))
    async with day.journaled() as outcome:
        await play(day, schedule)
        final = await day.judged(outcome)
        day.journal_sections["generator"].update(figures(day, outcome.verdicts, final))
        broken = broken_rules(outcome.verdicts, day.required)
        if not broken:
            return
        lines = [*broken, f"replay: {replay_command(config, day, schedule, replay)}"]
        runs: int = config.getoption("--shrink-runs")
        if runs > 0 and len(schedule.steps) > 1:
            rules = {v.checker for v in failed(outcome.verdicts)} or set(day.required)

            async def still_fails(steps: tuple[Step, ...]) -> bool:
                verdicts = await verdicts_of(day, schedule.with_steps(steps))
                return any(r.split(":")[0] in rules for r in broken_rules(verdicts,
                                                                         day.required))
            shrunk = await shrink(schedule.steps, still_fails, max_runs=runs)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", day.name)
            path = write(schedule.with_steps(shrunk.items),
                         day.report_dir / f"{name}-{day.run_id}-shrunk.schedule.json")
            lines += [f"shrunk in {shrunk.runs} game days from {len(schedule.steps)} to "
                      f"{len(shrunk.items)} steps"
                      f"{'' if shrunk.minimal else ' (the run cap stopped it before minimal)'}"
                      f": {'; '.join(s.describe() for s in shrunk.items)}",
                      f"replay the shrunk schedule: "
                      f"{replay_command(config, day, schedule, str(path))}"]
        day.notes.extend(lines)
        raise AssertionError("the random game day broke rules:\n" + "\n".join(lines))

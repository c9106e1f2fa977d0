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

import pytest

from harness.generator.play import play
from harness.generator.random_day import RandomDay, parametrize_schedules
from harness.record.gameday import GameDay

SCENARIO = "scenarios/random_gameday.py"
CHECKED = ("no_action_after_kill_ack", "in_progress_requeued", "no_wake_of_stopped_agent",
           "every_fault_healed", "no_task_lost", "none_done_twice",
           "kill_confirmed_within_lease", "no_sandbox_alive_after_stop",
           "fleet_resume_keeps_own_kills", "wake_paths_refused_while_stopped")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per schedule: seeds --seed, --seed+1, ... so that `--seed S --schedules 1`
    replays the schedule of seed S; or the one schedule of --replay."""
    parametrize_schedules(metafunc)


# in_progress_requeued may stay undecided: a schedule need not kill a working agent.
@pytest.mark.checkers(*CHECKED)
@pytest.mark.decides("no_task_lost", "none_done_twice", "every_fault_healed")
async def test_random_gameday(gameday: GameDay, agents_per_game_day: int,
                              schedule_seed: int | None, request: pytest.FixtureRequest) -> None:
    day = gameday
    random_day = RandomDay.of(day, request.config, SCENARIO, schedule_seed,
                              agents_per_game_day)
    outcome = day.outcome
    await play(day, random_day.schedule)
    final = await day.judged(outcome)
    day.journal_sections["generator"].update(random_day.figures(outcome.verdicts, final))
    # Every rule broken, how to replay the schedule, and a shrunk one that still fails.
    broken = await random_day.broken(outcome.verdicts)
    if broken:
        day.notes.extend(broken)
        raise AssertionError("the random game day broke rules:\n" + "\n".join(broken))

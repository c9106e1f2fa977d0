"""A random game day as pytest runs it: which schedules a run plays (seeds `--seed`,
`--seed`+1, ... or the one of `--replay`), the schedule of one, the soak's counts, and when
one breaks a rule, the schedule shrunk to a minimal one that still breaks it, with the
commands that replay both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from harness.generator.faults import usable_faults
from harness.generator.play import verdicts_of
from harness.generator.schedule import Schedule, Step, from_journal, generate, write
from harness.generator.shrink import shrink
from harness.judge.checkers import FinalState, Verdict
from harness.judge.switch_checkers import task_fates
from harness.judge.verdicts import broken_rules, failed
from harness.record.gameday import GameDay
from harness.run.plugin import run_seed


def parametrize_schedules(metafunc: pytest.Metafunc) -> None:
    """One test per schedule, as `schedule_seed`: seeds --seed, --seed+1, ... so that
    `--seed S --schedules 1` replays the schedule of seed S; or the one schedule of --replay
    (None), which must be readable before a stack comes up."""
    if "schedule_seed" not in metafunc.fixturenames:
        return
    config = metafunc.config
    replay = config.getoption("--replay")
    if replay:
        try:
            from_journal(replay)
        except (OSError, ValueError, KeyError, TypeError) as bad:
            raise pytest.UsageError(f"--replay {replay}: {bad}") from bad
        metafunc.parametrize("schedule_seed", [None], ids=["replay"])
        return
    count: int = config.getoption("--schedules")
    if count < 1:
        raise pytest.UsageError("--schedules must be at least 1")
    seeds = [run_seed(config) + i for i in range(count)]
    metafunc.parametrize("schedule_seed", seeds, ids=[f"seed{s}" for s in seeds])


@dataclass(frozen=True)
class RandomDay:
    """One random game day of `scenario`: its schedule, and how to replay it."""

    day: GameDay
    config: pytest.Config
    scenario: str  # the path pytest runs, for the replay commands
    schedule: Schedule
    replay: str | None  # the journal or schedule file it came from, if replayed

    @classmethod
    def of(cls, day: GameDay, config: pytest.Config, scenario: str, seed: int | None,
           agents: int) -> RandomDay:
        replay: str | None = config.getoption("--replay")
        schedule = (from_journal(replay) if replay else
                    generate(int(seed or 0), agents=agents,
                             duration_s=config.getoption("--duration"),
                             faults=usable_faults(day)))
        return cls(day, config, scenario, schedule, replay)

    def replay_command(self, replay: str | None) -> str:
        how = (f"--replay {replay}" if replay else
               f"--seed {self.schedule.seed} --schedules 1 --agents "
               f"{len(self.schedule.agents)} --duration {self.schedule.duration_s:g}")
        return f"pytest {self.scenario} --stack {self.day.stack} {how}"

    def figures(self, verdicts: list[Verdict], final: FinalState) -> dict[str, int]:
        """The soak's counts for this schedule (benchmarks/soak.py adds them up)."""
        lost, _ = task_fates(final)
        late = next((v for v in verdicts if v.checker == "no_action_after_kill_ack"
                     and v.valid is False), None)
        return {"tasks": len(final.tasks), "lost_tasks": len(lost),
                "done_twice": sum(1 for t in final.tasks.values() if t["done_count"] > 1),
                "actions_after_kill_ack": 0 if late is None else sum(
                    1 for i in late.evidence if self.day.history[i].f == "action")}

    async def broken(self, verdicts: list[Verdict]) -> list[str]:
        """The rules the game day broke and how to replay it; with --shrink-runs, a schedule
        shrunk to fewer steps that still breaks one of them, written beside the journals,
        and how to replay that. Empty when every rule held."""
        day, schedule = self.day, self.schedule
        broken = broken_rules(verdicts, day.required)
        if not broken:
            return []
        lines = [*broken, f"replay: {self.replay_command(self.replay)}"]
        runs: int = self.config.getoption("--shrink-runs")
        if runs <= 0 or len(schedule.steps) <= 1:
            return lines
        rules = {v.checker for v in failed(verdicts)} or set(day.required)

        async def still_fails(steps: tuple[Step, ...]) -> bool:
            tried = await verdicts_of(day, schedule.with_steps(steps))
            return any(r.split(":")[0] in rules for r in broken_rules(tried, day.required))
        shrunk = await shrink(schedule.steps, still_fails, max_runs=runs)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", day.name)
        path = write(schedule.with_steps(shrunk.items),
                     day.report_dir / f"{name}-{day.run_id}-shrunk.schedule.json")
        cap = "" if shrunk.minimal else " (the run cap stopped it before minimal)"
        return [*lines, f"shrunk in {shrunk.runs} game days from {len(schedule.steps)} to "
                f"{len(shrunk.items)} steps{cap}: "
                f"{'; '.join(s.describe() for s in shrunk.items)}",
                f"replay the shrunk schedule: {self.replay_command(str(path))}"]

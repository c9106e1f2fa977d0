"""The one life of a game day, whoever starts it (the pytest plugin, `gameday run`, a
benchmark): steady state → scenario → collect → judge → journal → rollback.

    async with run_game_day(day):
        ...  # the scenario: it only acts

The scenario cannot skip its judgement: whatever it does, once its block ends (passed,
failed on a rule it saw broken, or aborted) the history is collected and judged, the journal
written, and the system rolled back. A game day that passed its own checks fails when its
verdicts break a rule or leave a required one undecided; one whose judgement could not run
fails saying so, never passes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from harness.judge.verdicts import broken_rules
from harness.nemesis import halt
from harness.record.gameday import GameDay, VerdictsBroken, phases
from harness.run.rollback import RollbackFailed


class GameDayNotJudged(AssertionError):
    """The game day ran but its history could not be judged: it proves nothing."""


@asynccontextmanager
async def run_game_day(day: GameDay) -> AsyncIterator[GameDay]:
    """Prepare `day` (SteadyStateNotMet: it did not start, its journal says which probe
    failed), run the block, judge, journal, roll back. What a rollback could not restore is
    in the journal and in `day.left_standing`, for the caller to say loudly."""
    status = "not_started"
    outcome = day.outcome
    try:
        await day.prepare()  # a refusal writes its own journal, naming the probe
        phases.info("the scenario runs")
        status = "aborted"
        try:
            yield day
        except VerdictsBroken:  # the scenario judged early and read its verdicts
            status = "failed"
            raise
        except AssertionError as exc:  # a rule it saw broken as it went on
            status = "failed"
            text = str(exc).strip()
            day.seen_broken = text.splitlines()[0] if text else type(exc).__name__
            raise
        except BaseException as exc:  # Ctrl-C, SIGTERM, the halt switch, a broken stack
            day.aborted_reason = halt.abort_reason(exc)
            day.notes.append(f"aborted: {day.aborted_reason}")
            raise
        finally:
            if outcome.final is None:
                try:
                    await day.judged(outcome)
                except Exception as exc:  # the journal still says what happened
                    day.notes.append(f"judging failed: {exc!r}")
                    if day.aborted_reason is None:
                        day.aborted_reason = f"the history could not be judged: {exc!r}"
        if outcome.final is None:
            raise GameDayNotJudged(f"the game day {day.name} ran but could not be judged "
                                   f"({day.aborted_reason}): a game day nobody judged proves "
                                   f"nothing")
        broken = broken_rules(outcome.verdicts, day.required)
        status = "failed" if broken else "completed"
        if broken:
            raise VerdictsBroken("\n".join(broken))
    finally:
        if status != "not_started":
            outcome.journal = day.journal(status, outcome.verdicts, outcome.samples,
                                          outcome.steady_after)
            print(f"journal: {outcome.journal} ({status})")
        phases.info("rolling the game day back")
        day.rolled_back = True
        try:
            await day.roll_back()
        except RollbackFailed as failed:
            # Kept, not raised over the game day's own outcome: whoever runs the game day
            # says it loudly once it is over (the pytest fixture fails its teardown).
            day.left_standing = str(failed)

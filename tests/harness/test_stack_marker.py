"""`@pytest.mark.stacks(...)`: a game day limited to some stacks is skipped on another before
any stack is brought up (its fixture would fail here if it were set up), saying why; real
pytest in a subprocess, as `pytest scenarios --stack processes` runs in CI."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest


@pytest.fixture
def gameday():
    raise AssertionError("the game day's stack was brought up")
"""

SCENARIO = """
import pytest


@pytest.mark.stacks("containers", why="it kills containers")
async def test_only_on_containers(gameday):
    pass


@pytest.mark.stacks("processes")
def test_on_processes():
    pass
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    (pytester.mkdir("scenarios") / "drill.py").write_text(SCENARIO)
    return pytester.runpytest_subprocess("scenarios", "-p", "no:cacheprovider", "-rs", *args)


def test_a_game_day_of_another_stack_is_skipped_before_its_stack_is_up(
        pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--stack", "processes")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*this game day runs on the containers stack only, not on "
                                 "processes: it kills containers (--any-stack runs it here)*"])


def test_any_stack_runs_it_all_the_same(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--stack", "processes", "--any-stack")
    # Its fixture ran: the stack would have been brought up.
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the game day's stack was brought up*"])


def test_a_stack_that_does_not_exist_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    (pytester.mkdir("scenarios") / "drill.py").write_text(
        "import pytest\n\n@pytest.mark.stacks('kubernetes')\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("scenarios", "-p", "no:cacheprovider",
                                           "--stack", "processes")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*@pytest.mark.stacks names no stack kubernetes; stacks: "
                                 "containers, processes, target*"])

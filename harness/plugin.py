"""The pytest plugin (entry point `pytest11`): options, the stack, and a game day per test.

    pytest scenarios/fleet_stop.py [--stack processes|target] [--agents 5] [--seed 7]
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harness.gameday import GameDay
from harness.stack import ProcessesStack, Stack, TargetStack

STACKS = ("containers", "processes", "target")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("covey game day")
    group.addoption("--stack", choices=STACKS, default=None,
                    help="where the system under test runs (default: processes; the "
                         "containers stack is not built yet)")
    group.addoption("--target-url", default=os.environ.get("COVEY_TARGET_URL"),
                    help="with --stack target: the deployment's base URL")
    group.addoption("--target-email", default=os.environ.get("COVEY_TARGET_EMAIL"),
                    help="with --stack target: an org admin's email")
    group.addoption("--target-password", default=os.environ.get("COVEY_TARGET_PASSWORD"),
                    help="with --stack target: that admin's password")
    group.addoption("--puppet-port", type=int, default=None,
                    help="with --stack target: serve the puppet model on this port (the "
                         "deployment's COVEY_MODEL_URL points at it)")
    group.addoption("--agents", type=int, default=5, help="agents per game day (default 5)")
    group.addoption("--report-dir", default="reports", help="where journals go")
    group.addoption("--seed", type=int, default=None,
                    help="seed of the generated people and agents (default: random, printed)")


def _stack_name(config: pytest.Config) -> str:
    chosen: str | None = config.getoption("--stack")
    return chosen or "processes"


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = _stack_name(config)
    why = "chosen" if config.getoption("--stack") else "default"
    return [f"covey game day: stack={name} ({why}), agents={config.getoption('--agents')}, "
            f"seed={_seed(config)}, reports in {config.getoption('--report-dir')}/"]


def _seed(config: pytest.Config) -> int:
    seed: int | None = config.getoption("--seed")
    if seed is None:
        cached: int | None = getattr(config, "_covey_seed", None)
        if cached is None:
            cached = random.SystemRandom().randrange(1, 1_000_000)
            config._covey_seed = cached  # type: ignore[attr-defined]
        return cached
    return seed


def make_stack(config: pytest.Config) -> Stack:
    name = _stack_name(config)
    report_dir = Path(config.getoption("--report-dir"))
    if name == "processes":
        return ProcessesStack(report_dir)
    if name == "target":
        url, email, password = (config.getoption("--target-url"),
                                config.getoption("--target-email"),
                                config.getoption("--target-password"))
        if not (url and email and password):
            raise pytest.UsageError("--stack target needs --target-url, --target-email and "
                                    "--target-password (or COVEY_TARGET_* variables)")
        return TargetStack(url, email, password, config.getoption("--puppet-port"))
    raise pytest.UsageError("the containers stack is not built yet; use --stack processes")


@pytest.fixture
def agents_per_game_day(request: pytest.FixtureRequest) -> int:
    count: int = request.config.getoption("--agents")
    if count < 1:
        raise pytest.UsageError("--agents must be at least 1")
    return count


@pytest.fixture
async def gameday(request: pytest.FixtureRequest) -> AsyncIterator[GameDay]:
    """A stack brought up for this test, with its people enlisted; torn down afterwards,
    also when the test fails."""
    config = request.config
    stack = make_stack(config)
    async with stack.up() as endpoints:
        day = GameDay(name=request.node.name, stack=stack.name, endpoints=endpoints,
                      seed=_seed(config), report_dir=Path(config.getoption("--report-dir")))
        try:
            await day.enlist()
            yield day
        finally:
            await day.close()

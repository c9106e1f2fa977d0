"""The pytest plugin (entry point `pytest11`): options, the stack, and a game day per test.

    pytest scenarios/fleet_stop.py [--stack processes|target] [--agents 5] [--seed 7]
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harness.gameday import GameDay, phases
from harness.report.summary import pytest_sessionfinish, pytest_terminal_summary, record
from harness.stack import ContainersStack, ProcessesStack, Stack, TargetStack

# Hooks of the report's, found by pytest under these names in this plugin module.
__all__ = ["pytest_sessionfinish", "pytest_terminal_summary"]

STACKS = ("containers", "processes", "target")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("covey game day")
    group.addoption("--stack", choices=STACKS, default=None,
                    help="where the system under test runs (default: containers where a "
                         "Docker engine answers and has the stack's image, else processes)")
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


def _image() -> str:
    return os.environ.get("COVEY_SANDBOX_IMAGE", "covey-gameday:latest")


def _docker_ready() -> str | None:
    """None when a Docker engine answers and has the stack's image, else why not."""
    try:
        import docker

        client = docker.from_env()
        try:
            client.ping()
            client.images.get(_image())
        finally:
            client.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def _stack_name(config: pytest.Config) -> tuple[str, str]:
    """The stack and why it was taken, decided once per run."""
    cached: tuple[str, str] | None = getattr(config, "_covey_stack", None)
    if cached is None:
        chosen: str | None = config.getoption("--stack")
        if chosen:
            cached = (chosen, "chosen")
        else:
            missing = _docker_ready()
            cached = (("containers", "default: a Docker engine answers") if missing is None
                      else ("processes", f"default: no Docker engine with {_image()} "
                                         f"({missing})"))
        config._covey_stack = cached  # type: ignore[attr-defined]
    return cached


def pytest_report_header(config: pytest.Config) -> list[str]:
    name, why = _stack_name(config)
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
    name, _ = _stack_name(config)
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
    return ContainersStack(report_dir, image=_image())


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
    phases.info("%s: bringing the %s stack up", request.node.name, stack.name)
    async with stack.up() as endpoints:
        day = GameDay(name=request.node.name, stack=stack.name, endpoints=endpoints,
                      seed=_seed(config), report_dir=Path(config.getoption("--report-dir")),
                      scenario=request.node.nodeid)
        try:
            phases.info("stack up at %s; enlisting the game day's people", endpoints.url)
            await day.enlist()
            phases.info("the scenario runs")
            yield day
        finally:
            await day.close()
            record(request.node, day.journals)
            phases.info("tearing the %s stack down", stack.name)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Game days are the modules of a `scenarios/` folder, whatever their names: a plain
    `pytest` (or `pytest scenarios/`) runs them too. Files named on the command line are
    collected by pytest itself."""
    if (file_path.suffix == ".py" and file_path.parent.name == "scenarios"
            and not file_path.name.startswith(("_", "conftest"))
            and not parent.session.isinitpath(file_path)):
        module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
        return module
    return None

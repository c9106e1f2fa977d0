"""The pytest plugin (entry point `pytest11`): options, the stack, and a game day per test.

    pytest scenarios/fleet_stop.py [--stack processes|target] [--agents 5] [--seed 7]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from pathlib import Path
from typing import Any, Protocol, cast

import pytest

from harness.act.dialect import AUTO, COVEY_GAMEDAY, DIALECTS
from harness.judge.bounds import FIGURES
from harness.judge.checkers import CHECKERS, Checker
from harness.judge.costs import MEASURES, Measure
from harness.judge.switch_checkers import CATALOGUE
from harness.judge.verdicts import KNOWN_CHECKERS, broken_rules, render
from harness.nemesis import halt
from harness.record.gameday import GameDay, phases
from harness.report.summary import (
    game_day_written,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from harness.run.lifecycle import run_game_day
from harness.run.rollback import RollbackFailed, roll_back_loudly
from harness.run.steady import SteadyStateNotMet
from harness.stack.base import Endpoints, Stack
from harness.stack.containers import ContainersStack
from harness.stack.isolation import isolation_header
from harness.stack.processes import ProcessesStack
from harness.stack.target import TargetStack

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
    group.addoption("--target-platform-email",
                    default=os.environ.get("COVEY_TARGET_PLATFORM_EMAIL"),
                    help="with --stack target: a platform admin's email; then every game day "
                         "runs in a fresh organisation of its own")
    group.addoption("--target-platform-password",
                    default=os.environ.get("COVEY_TARGET_PLATFORM_PASSWORD"),
                    help="with --stack target: that platform admin's password")
    group.addoption("--dialect", choices=(AUTO, *DIALECTS), default=AUTO,
                    help="with --stack target: the API the deployment speaks: this project's "
                         "(covey-gameday), upstream covey's (upstream), or found from its "
                         "/healthz (auto, the default)")
    group.addoption("--puppet-port", type=int, default=None,
                    help="with --stack target: serve the puppet model on this port (the "
                         "deployment's COVEY_MODEL_URL points at it)")
    group.addoption("--reuse-stack", action="store_true",
                    help="bring the stack up once for the whole run (each game day still "
                         "runs in an organisation of its own on it)")
    group.addoption("--any-stack", action="store_true",
                    help="run game days marked `stacks(...)` on this stack all the same")
    group.addoption("--agents", type=int, default=5, help="agents per game day (default 5)")
    group.addoption("--report-dir", default="reports", help="where journals go")
    group.addoption("--seed", type=int, default=None,
                    help="seed of the generated people and agents (default: random, printed)")
    group.addoption("--schedules", type=int, default=2,
                    help="random game days (scenarios/random_gameday.py): how many seeded "
                         "schedules, with seeds --seed, --seed+1, ... (default 2)")
    group.addoption("--duration", type=float, default=15.0,
                    help="random game days: seconds of operations and faults per schedule "
                         "(default 15)")
    group.addoption("--replay", default=None, metavar="FILE",
                    help="random game days: replay the schedule of this journal (or of a "
                         "shrunk schedule's file) instead of drawing one")
    group.addoption("--shrink-runs", type=int, default=8,
                    help="random game days: at most this many game days to shrink a failing "
                         "schedule with (0: do not shrink; default 8)")


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
    reused = ", one for the whole run" if config.getoption("--reuse-stack") else ""
    return [f"covey game day: stack={name} ({why}{reused}), "
            f"agents={config.getoption('--agents')}, "
            f"seed={_seed(config)}, reports in {config.getoption('--report-dir')}/",
            f"covey game day: {isolation_header(name, _platform_admin(config) is not None)}"]


def _platform_admin(config: pytest.Config) -> tuple[str, str] | None:
    email, password = (config.getoption("--target-platform-email"),
                       config.getoption("--target-platform-password"))
    return (email, password) if email and password else None


def run_seed(config: pytest.Config) -> int:
    """The run's seed: `--seed`, or one drawn once per run (and printed in the header)."""
    return _seed(config)


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
    if name != "target" and config.getoption("--dialect") not in (AUTO, COVEY_GAMEDAY):
        raise pytest.UsageError(f"--dialect {config.getoption('--dialect')} needs --stack "
                                f"target: the {name} stack runs this project's control plane")
    if name == "processes":
        return ProcessesStack(report_dir)
    if name == "target":
        url, email, password = (config.getoption("--target-url"),
                                config.getoption("--target-email"),
                                config.getoption("--target-password"))
        if not (url and email and password):
            raise pytest.UsageError("--stack target needs --target-url, --target-email and "
                                    "--target-password (or COVEY_TARGET_* variables)")
        platform = _platform_admin(config)
        platform_email, platform_password = platform or (None, None)
        return TargetStack(url, email, password, config.getoption("--puppet-port"),
                           platform_email, platform_password,
                           dialect=config.getoption("--dialect"))
    return ContainersStack(report_dir, image=_image())


@pytest.fixture
def agents_per_game_day(request: pytest.FixtureRequest) -> int:
    count: int = request.config.getoption("--agents")
    if count < 1:
        raise pytest.UsageError("--agents must be at least 1")
    return count


@pytest.fixture(scope="session")
async def reused_stack(request: pytest.FixtureRequest) -> AsyncIterator[Endpoints | None]:
    """With --reuse-stack, the one stack of the run; else None (a stack per game day)."""
    if not request.config.getoption("--reuse-stack"):
        yield None
        return
    async with make_stack(request.config).up() as endpoints:
        yield endpoints


@pytest.fixture
async def gameday(request: pytest.FixtureRequest, reused_stack: Endpoints | None
                  ) -> AsyncIterator[GameDay]:
    """A stack brought up for this test (or the run's, with --reuse-stack) and the game day
    on it. Its organisation, people and steady state, its judgement, journal and rollback
    are run_game_day's, around the test's call (pytest_runtest_call); the stack is torn
    down afterwards, also when the test fails."""
    config = request.config
    refused_by_halt = halt.refusal()
    if refused_by_halt is not None:
        pytest.fail(refused_by_halt, pytrace=False)
    name, _ = _stack_name(config)
    if reused_stack is not None:
        reused_stack.nemesis.begin_game_day()
    else:
        phases.info("%s: bringing the %s stack up", request.node.name, name)
    stack = make_stack(config) if reused_stack is None else None
    for mark, what in ((TICK_MARK, "a scheduler tick of {} ms"),
                       (HEARTBEAT_MIN_MARK, "a heartbeat minimum of {} s"),
                       (LEASE_MARK, "a kill-flag lease of {} ms")):
        asked = request.node.get_closest_marker(mark)
        if asked is None:
            continue
        if stack is None or not hasattr(stack, mark):
            pytest.skip(f"this game day needs {what.format(asked.args[0])}, and the {name} "
                        f"stack{' reused for the run' if stack is None else ''} cannot be "
                        f"given one")
        setattr(stack, mark, int(asked.args[0]))
    async with (contextlib.nullcontext(cast(Endpoints, reused_stack)) if stack is None
                else stack.up()) as endpoints, halt.game_day_running():
        required = required_checkers(request.node)
        day = GameDay(name=request.node.name, stack=name, endpoints=endpoints,
                      seed=_seed(config), report_dir=Path(config.getoption("--report-dir")),
                      required=required, scenario=replay_node(request.node),
                      checkers=chosen_checkers(request.node, required),
                      measures=chosen_measures(request.node),
                      bounds=chosen_bounds(request.node))
        phases.info("stack up at %s", endpoints.url)
        try:
            # The test's call runs the scenario inside run_game_day (pytest_runtest_call):
            # steady state, judgement, journal and rollback are the harness's, not the
            # scenario's to remember.
            yield day
        finally:
            left_standing = day.left_standing
            try:
                if not day.rolled_back:
                    await roll_back_loudly(day)
            except RollbackFailed as failed:
                left_standing = str(failed)
            await day.close()
            # The page after the rollback: it shows what was restored.
            game_day_written(request.node, day.journal_path)
            if left_standing is not None:  # loud, and without a traceback in the way
                pytest.fail(left_standing, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A game day's test function (a coroutine taking the `gameday` fixture) runs inside
    run_game_day: prepared, judged, journaled and rolled back whatever it does."""
    day = getattr(item, "funcargs", {}).get("gameday")
    scenario = getattr(item, "obj", None)
    if not isinstance(day, GameDay) or not inspect.iscoroutinefunction(scenario):
        return (yield)
    item.obj = owned_by_the_harness(scenario, day)  # type: ignore[attr-defined]
    try:
        return (yield)
    finally:
        item.obj = scenario  # type: ignore[attr-defined]


def owned_by_the_harness(scenario: Callable[..., Awaitable[None]], day: GameDay
                         ) -> Callable[..., Awaitable[None]]:
    @functools.wraps(scenario)
    async def game_day(*args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        refused: str | None = None
        try:
            async with run_game_day(day):
                await scenario(*args, **kwargs)
        except SteadyStateNotMet as not_met:
            refused = f"the game day did not start: {not_met}"
        if refused is not None:  # outside the except: no chained traceback
            pytest.fail(refused, pytrace=False)
    return game_day


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Game days bring a stack up and run for tens of seconds, and Docker tests need an
    engine: both are `slow`, so `pytest -m "not slow"` is the fast tier of the inner loop."""
    for item in items:
        if "gameday" in getattr(item, "fixturenames", ()) or item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A game day marked `stacks("processes", why=...)` runs on those stacks only: on another
    it is skipped before a stack is brought up, saying why (`--any-stack` runs it anyway)."""
    mark = item.get_closest_marker(STACKS_MARK)
    if mark is None:
        return
    unknown = set(mark.args) - set(STACKS)
    if not mark.args or unknown:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{STACKS_MARK} names no stack "
                                f"{', '.join(sorted(unknown))}; stacks: {', '.join(STACKS)}")
    name, _ = _stack_name(item.config)
    if name not in mark.args and not item.config.getoption("--any-stack"):
        why = mark.kwargs.get("why")
        pytest.skip(f"this game day runs on the {' and '.join(mark.args)} stack only, not on "
                    f"{name}" + (f": {why}" if why else "") + " (--any-stack runs it here)")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Game days are the modules of a `scenarios/` folder, whatever their names: a plain
    `pytest` (or `pytest scenarios/`) runs them too. Files named on the command line are
    collected by pytest itself."""
    if (file_path.suffix == ".py" and file_path.parent.name == "scenarios"
            and not file_path.name.startswith(("_", "conftest"))
            and not parent.session.isinitpath(file_path)):
        rewrite_asserts_of(file_path, parent.config.rootpath)
        module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
        return module
    return None


# ---------------------------------------------------------------------- assertion rewriting

def rewrite_asserts_of(file_path: Path, rootpath: Path) -> None:
    """pytest rewrites the asserts of the modules it collects by their file names
    (`python_files`) or names on the command line; a game day collected here by its folder
    is neither, and its failing `assert r.status_code == 409` would show a bare
    AssertionError. So its import names are registered for rewriting before pytest imports
    it: the dotted name from its outermost package (the `prepend` and `append` import modes,
    and `importlib` inside a package) and its path from the rootdir (`importlib` outside
    one)."""
    pytest.register_assert_rewrite(*import_names(file_path, rootpath))


def import_names(file_path: Path, rootpath: Path) -> list[str]:
    parts = [file_path.stem]
    folder = file_path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    names = [".".join(parts)]
    try:
        from_root = file_path.with_suffix("").relative_to(rootpath).parts
    except ValueError:
        return names
    if from_root and ".".join(from_root) not in names:
        names.append(".".join(from_root))
    return names


# ---------------------------------------------------------------------- verdicts first

DECIDES = "decides"
CHECKERS_MARK = "checkers"
TICK_MARK = "tick_ms"
HEARTBEAT_MIN_MARK = "heartbeat_min_s"
LEASE_MARK = "lease_ms"
MEASURES_MARK = "measures"
BOUNDS_MARK = "bounds"
STACKS_MARK = "stacks"


def pytest_configure(config: pytest.Config) -> None:
    halt.stop_on_sigterm()
    config.addinivalue_line(
        "markers", f"{DECIDES}(*checkers): checkers this game day must be able to decide; an "
                   f"`unknown` verdict from one of them fails it")
    config.addinivalue_line(
        "markers", f"{TICK_MARK}(ms): bring this game day's own stack up with this scheduler "
                   f"tick (skipped with --reuse-stack and on a deployment)")
    config.addinivalue_line(
        "markers", f"{HEARTBEAT_MIN_MARK}(s): bring this game day's own stack up with this "
                   f"shortest heartbeat period (COVEY_HEARTBEAT_MIN_S; skipped with "
                   f"--reuse-stack and on a deployment)")
    config.addinivalue_line(
        "markers", f"{LEASE_MARK}(ms): bring this game day's own stack up with this kill-flag "
                   f"lease (COVEY_LEASE_MS; skipped with --reuse-stack and on a deployment)")
    config.addinivalue_line(
        "markers", f"{STACKS_MARK}(*stacks, why=...): run this game day on these stacks only "
                   f"(skipped on another, before its stack is up, unless --any-stack)")
    config.addinivalue_line(
        "markers", f"{CHECKERS_MARK}(*checkers): judge this game day with these checkers "
                   f"(and those it decides) instead of the default set")
    config.addinivalue_line(
        "markers", f"{MEASURES_MARK}(*measures): figures to take beside time-to-stop "
                   f"({', '.join(MEASURES)})")
    config.addinivalue_line(
        "markers", f"{BOUNDS_MARK}(**figures): the figures this game day exists for, each "
                   f"with the most it may reach ({', '.join(FIGURES)}); past it, or not "
                   f"measured, the game day fails")


def marked_checkers(node: pytest.Item | pytest.Collector, mark_name: str) -> frozenset[str]:
    """The checker names a game day's `mark_name` markers give (module, class and
    function); a name that is no checker is a usage error."""
    names = {str(name) for mark in node.iter_markers(mark_name) for name in mark.args}
    unknown = names - KNOWN_CHECKERS
    if unknown:
        raise pytest.UsageError(f"{node.nodeid}: @pytest.mark.{mark_name} names no checker "
                                f"{', '.join(sorted(unknown))}; checkers: "
                                f"{', '.join(sorted(KNOWN_CHECKERS))}")
    return frozenset(names)


def replay_node(node: pytest.Item) -> str:
    """The test as a pytest argument that finds it again from where pytest was started: the
    file (relative to there when under it) and the test's name. A node id alone is relative
    to the rootdir, and once read `::test_...` with no file at all."""
    path = Path(node.path)
    started = node.config.invocation_params.dir
    try:
        where = str(path.relative_to(started))
    except ValueError:
        where = str(path)
    name = node.nodeid.split("::", 1)[1] if "::" in node.nodeid else node.name
    return f"{where}::{name}"


def required_checkers(node: pytest.Item | pytest.Collector) -> frozenset[str]:
    """The checkers a game day's `decides` markers name."""
    return marked_checkers(node, DECIDES)


def chosen_checkers(node: pytest.Item | pytest.Collector, required: frozenset[str]
                    ) -> tuple[Checker, ...]:
    """The checkers of a game day's `checkers` markers and those it decides, in the
    catalogue's order; the default set when it names none."""
    names = marked_checkers(node, CHECKERS_MARK)
    if not names:
        return tuple(dict.fromkeys([*CHECKERS, *(c for c in CATALOGUE
                                                  if c.__name__ in required)]))
    return tuple(c for c in CATALOGUE if c.__name__ in names | required)


def chosen_bounds(node: pytest.Item | pytest.Collector) -> dict[str, float]:
    """The figures a game day's `bounds` markers name, with their bounds."""
    bounds: dict[str, float] = {}
    for mark in node.iter_markers(BOUNDS_MARK):
        for figure, bound in mark.kwargs.items():
            if figure not in FIGURES:
                raise pytest.UsageError(f"{node.nodeid}: @pytest.mark.{BOUNDS_MARK} names no "
                                        f"figure {figure}; figures: {', '.join(FIGURES)}")
            if not isinstance(bound, int | float) or bound < 0:
                raise pytest.UsageError(f"{node.nodeid}: the bound of {figure} must be a "
                                        f"number at least 0, not {bound!r}")
            bounds.setdefault(figure, float(bound))  # the closest marker wins
    return bounds


def chosen_measures(node: pytest.Item | pytest.Collector) -> dict[str, Measure]:
    names = [str(n) for mark in node.iter_markers(MEASURES_MARK) for n in mark.args]
    unknown = set(names) - set(MEASURES)
    if unknown:
        raise pytest.UsageError(f"{node.nodeid}: @pytest.mark.{MEASURES_MARK} names no "
                                f"measure {', '.join(sorted(unknown))}; measures: "
                                f"{', '.join(MEASURES)}")
    return {n: MEASURES[n] for n in names}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed game day's report leads with its failed and undecided verdicts, whatever
    line of the scenario raised first: the checker's sentence says what broke."""
    report = yield
    if report.when != "call" or not report.failed:
        return report
    day = getattr(item, "funcargs", {}).get("gameday")
    if not isinstance(day, GameDay):
        return report
    required = (required_checkers(item) - set(day.lacks)) | day.required
    text = render(day.verdicts, required, day.history, day.seen_broken)
    if text is not None:
        rules = ([day.seen_broken] if day.seen_broken else []) + broken_rules(
            day.verdicts, required)
        report.longrepr = cast(Any, VerdictsFirst(text, rules[0] if rules else None,
                                                  report.longrepr))
    return report


class _Writer(Protocol):
    def line(self, s: str = "", **markup: bool) -> None: ...

    def sep(self, sepchar: str, title: str | None = None, fullwidth: int | None = None,
            **markup: bool) -> None: ...


class VerdictsFirst:
    """pytest's failure representation with the verdicts put before it. Duck-typed as
    pytest reads one: `toterminal` for the terminal, `str` for JUnit and xdist, `reprcrash`
    for the one-line summary (which then names the first broken rule)."""

    def __init__(self, verdicts: str, headline: str | None, original: Any) -> None:
        self.verdicts = verdicts
        self.original = original
        crash: Any = getattr(original, "reprcrash", None)
        self.reprcrash: Any = crash
        if (headline is not None and dataclasses.is_dataclass(crash)
                and not isinstance(crash, type)):
            self.reprcrash = dataclasses.replace(
                crash, message=f"{headline} | then: {getattr(crash, 'message', '')}")

    def toterminal(self, tw: _Writer) -> None:
        for line in self.verdicts.splitlines():
            tw.line(line, red=line.startswith(("FAILED", "UNDECIDED", "MISSING")),
                    bold=not line.startswith(" "))
        tw.sep("-", "where the scenario raised")
        if hasattr(self.original, "toterminal"):
            self.original.toterminal(tw)
        else:
            tw.line(str(self.original))

    def __str__(self) -> str:
        return f"{self.verdicts}\n\n{self.original}"

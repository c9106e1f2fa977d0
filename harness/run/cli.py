"""The `gameday` command line.

    gameday run [SCENARIO...] [--stack processes] [--agents 5] [--seed 7]
    gameday halt [--reason TEXT]        gameday halt --release
    gameday report JOURNAL [--standalone]     gameday prune --keep 20
    gameday trend       gameday gate
    gameday load --users 50 --spawn-rate 10 --run-time 2m --agents 20 [--stack processes]
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, cast

import pytest
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.padding import Padding
from rich.table import Table

from harness.load.runner import LoadPlan, LoadResult, load_environment, prepare_fleet, run_load
from harness.load.runner import run_seconds as _run_seconds
from harness.nemesis import halt
from harness.nemesis.watchdog import every_users_state_dir, state_dir
from harness.report import retention, runs
from harness.report.page import write_page
from harness.report.trend import INDEX_PAGE, write_index
from harness.run import plugin
from harness.stack.base import Stack
from harness.stack.containers import ContainersStack
from harness.stack.processes import ProcessesStack
from harness.stack.target import TargetStack

app = typer.Typer(help="Game days for the kill switches of a covey agent fleet.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)
console = Console()


class StackName(StrEnum):
    containers = "containers"
    processes = "processes"
    target = "target"


@app.callback()
def main() -> None:
    """Game days for the kill switches of a covey agent fleet: `gameday COMMAND --help`."""


def make_stack(stack: StackName, report_dir: Path, target_url: str | None,
               target_email: str | None, target_password: str | None,
               puppet_port: int | None) -> Stack:
    if stack is StackName.processes:
        return ProcessesStack(report_dir)
    if stack is StackName.containers:
        return ContainersStack(report_dir, image=os.environ.get("COVEY_SANDBOX_IMAGE",
                                                                "covey-gameday:latest"))
    if not (target_url and target_email and target_password):
        raise typer.BadParameter("--stack target needs --target-url, --target-email and "
                                 "--target-password (or COVEY_TARGET_* variables)",
                                 param_hint="--stack")
    return TargetStack(target_url, target_email, target_password, puppet_port)


ReportDir = Annotated[Path, typer.Option(help="where journals and pages are")]


class _OptionsOf:
    """Reads the options the pytest plugin declares, to list them under `gameday run --help`
    (they pass through to pytest; a user should not have to know that to find them)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def getgroup(self, name: str) -> _OptionsOf:
        return self

    def addoption(self, *names: str, **spec: Any) -> None:
        metavar = "" if spec.get("action") == "store_true" else " " + str(
            spec.get("metavar") or names[0].lstrip("-").split("-")[-1].upper())
        self.lines.append(f"  {', '.join(names)}{metavar}: {spec.get('help', '')}")


def _plugin_options() -> str:
    options = _OptionsOf()
    plugin.pytest_addoption(cast(pytest.Parser, options))
    # \b: Click prints the block as it is, one option a line.
    return "\b\nThe game-day options of the pytest plugin, passed through:\n" + "\n".join(
        options.lines)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog=_plugin_options())
def run(
    context: typer.Context,
    scenarios: Annotated[list[str] | None, typer.Argument(
        help="game days to run (files or pytest node ids); default: every one in "
             "scenarios/")] = None,
    stack: Annotated[StackName | None, typer.Option(
        help="where the system runs (default: containers where a Docker engine has the "
             "stack's image, else processes)")] = None,
    agents: Annotated[int, typer.Option(help="agents per game day")] = 5,
    seed: Annotated[int | None, typer.Option(help="replay the same people and agents")]
        = None,
    report_dir: ReportDir = Path("reports"),
) -> None:
    """Run game days (pytest underneath: the same as `pytest scenarios/...`), showing each
    phase as it happens, and end with the summary. Options pytest knows may follow, e.g.
    `gameday run scenarios/fleet_stop.py -x --junitxml=gameday.xml`."""
    # This command is the harness package already imported, so pytest cannot rewrite the
    # asserts of the plugin's own modules (it warns); they carry their messages themselves.
    # Game-day modules are imported by pytest and rewritten as ever.
    refused = halt.refusal()
    if refused is not None:
        console.print(refused)
        raise typer.Exit(2)
    given = scenarios or []
    if stack is StackName.target:
        passed = " ".join([*given, *context.args])
        missing = [f"--target-{what}" for what in ("url", "email", "password")
                   if f"--target-{what}" not in passed
                   and not os.environ.get(f"COVEY_TARGET_{what.upper()}")]
        if missing:
            # One line, not pytest's UsageError traceback from inside a fixture.
            console.print(f"gameday run: --stack target needs {', '.join(missing)} (or "
                          "COVEY_TARGET_* variables)", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
    # Click hands pytest's own options (-x, -k EXPR) over among the arguments: without a
    # file or node id among them, the game days are scenarios/ (not the whole test suite).
    named = any(a.endswith(".py") or "::" in a or a.rstrip("/").endswith("scenarios")
                or Path(a).is_dir() for a in given if not a.startswith("-"))
    args = [*given, *([] if named else ["scenarios"]), "--agents", str(agents),
            "--report-dir", str(report_dir), "-p", "no:cacheprovider",
            "-W", "ignore:Module already imported so cannot be rewritten",
            *context.args]
    if stack is not None:
        args += ["--stack", stack.value]
    if seed is not None:
        args += ["--seed", str(seed)]
    # pytest captures file descriptors 1 and 2 while a test runs; the phases go to a copy of
    # the terminal's so that they show as they happen, not after the game day.
    terminal = Console(file=os.fdopen(os.dup(1), "w", buffering=1), highlight=False)
    handler = RichHandler(console=terminal, show_path=False, markup=False,
                          log_time_format="[%H:%M:%S]")
    phases = logging.getLogger("harness.record.gameday")
    phases.setLevel(logging.INFO)
    phases.addHandler(handler)
    try:
        code = pytest.main(args)
    finally:
        phases.removeHandler(handler)
    raise typer.Exit(int(code))


@app.command(name="halt")
def halt_command(
    reason: Annotated[str, typer.Option(help="why: it goes into every aborted journal")]
        = "halted by hand",
    release: Annotated[bool, typer.Option("--release", help="release a standing halt: game "
                                          "days may start again")] = False,
    all_users: Annotated[bool, typer.Option("--all-users", help="every user's game days on "
                                            "this machine, not only yours")] = False,
) -> None:
    """The harness's own stop switch: heal every standing fault of your game days on this
    machine at once (every user's with --all-users), stop the running game days (their
    journals say `aborted` with the reason), and refuse new ones until `gameday halt
    --release`."""
    roots = every_users_state_dir() if all_users else [state_dir()]
    if release:
        for root in roots:
            released = halt.release(root)
            console.print(f"{root}: no halt stood" if released is None
                          else f"{root}: halt released (it stood since {released['at']}: "
                               f"{released['reason']})")
        return
    failed = False
    for root in roots:
        pulled = halt.pull(reason, root)
        console.print(f"{root}: halt pulled ({reason}): {len(pulled.healed)} faults healed, "
                      f"{len(pulled.stopped_harnesses)} game days stopped "
                      f"{pulled.stopped_harnesses or ''}".rstrip())
        for fault_id, why in pulled.failed.items():
            console.print(f"  could not heal {fault_id}: {why}")
        failed = failed or bool(pulled.failed)
    console.print("new game days are refused until `gameday halt --release`")
    if failed:
        raise typer.Exit(1)


@app.command()
def report(journal: Annotated[Path, typer.Argument(help="a game day's journal (.json)",
                                                   exists=True, dir_okay=False)],
           standalone: Annotated[bool, typer.Option(
               "--standalone", help="inline the chart script (4.8 MB) so that the page "
                                    "opens alone, copied anywhere")] = False) -> None:
    """Render (again) the page of a game day from its journal and history. The page uses
    the report directory's shared plotly.min.js unless --standalone."""
    console.print(f"page: {write_page(journal, standalone=standalone)}")


@app.command()
def prune(
    keep: Annotated[int, typer.Option(help="journals to keep of each scenario, the newest "
                                           "(and of load runs)", min=1)],
    report_dir: ReportDir = Path("reports"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go, remove "
                                                            "nothing")] = False,
) -> None:
    """Keep the newest N journals of each scenario, with their history, page and logs, and
    remove the rest (and their rows in the index of runs). Keep more than the gate's
    --window, or it compares with fewer runs."""
    runs.index(report_dir)
    pruned = retention.prune(report_dir, keep, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for path in pruned.removed_files:
        console.print(f"{verb} {path}", highlight=False)
    console.print(f"kept the newest {keep} of each of {len(pruned.kept)} scenarios; {verb} "
                  f"{len(pruned.removed_journals)} journals, {len(pruned.removed_files)} files "
                  f"({pruned.removed_bytes / 1e6:.1f} MB)", highlight=False)
    if not dry_run and pruned.removed_journals and (report_dir / INDEX_PAGE).exists():
        write_index(report_dir)  # it linked the pages removed


@app.command()
def trend(report_dir: ReportDir = Path("reports")) -> None:
    """Every scenario over time: a table here and an index page of the report directory."""
    runs.index(report_dir)
    all_runs = runs.runs(report_dir)
    table = trend_table(report_dir, all_runs)
    wanted = console.measure(table, options=console.options.update(max_width=10_000)).maximum
    if not console.is_terminal:
        # A CI log or a pipe has no width: Rich would assume 80 columns and cut the scenario
        # names to `test_r…`. There each row stays one whole line, for people and for grep.
        Console(width=max(console.width, wanted), highlight=False).print(table)
    elif wanted <= console.width:
        console.print(table)
    else:
        # A terminal too narrow for the table: each scenario's full name on a line of its
        # own, its figures wrapped beneath it, rather than names folded letter by letter.
        console.print(table.title, highlight=False)
        for row in trend_rows(all_runs):
            console.print(row[0], style="bold", highlight=False)
            console.print(Padding(f"{row[1]}, {row[2]} agents: {row[3]} runs, latest "
                                  f"{row[4]} UTC {row[5]} · daemon exit p99 {_ms(row[6])} · "
                                  f"total p99 {_ms(row[7])}", (0, 0, 0, 4)), highlight=False)
    console.print(f"index page: {write_index(report_dir)}")


def _ms(cell: str) -> str:
    return "not measured" if cell == "-" else f"{cell} ms"


def trend_table(report_dir: Path, all_runs: list[runs.Run]) -> Table:
    table = Table(title=f"game days in {report_dir}/ ({len(all_runs)} runs)")
    for column in ("scenario", "stack", "agents", "runs", "latest (UTC)", "status",
                   "daemon exit p99 ms", "total p99 ms"):
        table.add_column(column, no_wrap=True)
    for row in trend_rows(all_runs):
        table.add_row(*row)
    return table


def trend_rows(all_runs: list[runs.Run]) -> list[tuple[str, ...]]:
    """The latest figures of every comparable group, as the table's cells."""
    return [(scenario, stack, str(agents), str(len(group_runs)),
             runs.minute(group_runs[-1].started_at), group_runs[-1].status,
             *(f"{group_runs[-1].p99_us[p] / 1000:.1f}" if p in group_runs[-1].p99_us else "-"
               for p in ("daemon_exit", "total")))
            for (scenario, stack, agents), group_runs in sorted(runs.groups(all_runs).items())]


@app.command()
def gate(
    report_dir: ReportDir = Path("reports"),
    ratio: Annotated[float, typer.Option(help="fail when a p99 is more than this times the "
                                              "median of earlier comparable runs")] = 2.0,
    min_delta_ms: Annotated[float, typer.Option(help="... and worse by more than this "
                                                     "(noise floor)")] = 50.0,
    window: Annotated[int, typer.Option(help="earlier comparable runs to take the median "
                                             "of")] = 10,
    min_runs: Annotated[int, typer.Option(help="earlier runs needed before a p99 is "
                                               "compared")] = 3,
    scenario: Annotated[str | None, typer.Option(help="gate only this game day")] = None,
) -> None:
    """Exit 1 when the latest run of a scenario failed a verdict or got slower than its
    history allows, with one line that says why; exit 0 with the figures otherwise."""
    runs.index(report_dir)
    result = runs.gate(runs.runs(report_dir), ratio=ratio, window=window, min_runs=min_runs,
                       min_delta_ms=min_delta_ms, scenario=scenario)
    for line in result.lines:
        # One line each, never wrapped: CI logs and people grep them.
        console.print(line, style=None if result.passed else "red", highlight=False,
                      soft_wrap=True)
    raise typer.Exit(0 if result.passed else 1)


@app.command()
def load(
    users: Annotated[int, typer.Option(help="operators reading and writing, beside the "
                                            "killers")] = 10,
    spawn_rate: Annotated[float, typer.Option(help="users started per second")] = 5.0,
    run_time: Annotated[str, typer.Option(help="how long the load runs: 20s, 2m, 1h")] = "1m",
    agents: Annotated[int, typer.Option(help="working agents the load runs against")] = 10,
    killers: Annotated[int, typer.Option(help="on-call engineers pulling agent switches, "
                                              "each a kill every 1-2 s")] = 1,
    stack: Annotated[StackName, typer.Option(help="where the control plane runs")]
        = StackName.processes,
    processes: Annotated[int, typer.Option(help="Locust worker processes on this machine "
                                                "(Locust's --processes)")] = 1,
    master: Annotated[int, typer.Option(help="run Locust as a master that waits for this "
                                             "many `locust --worker`s (from other machines)",
                                        metavar="WORKERS")] = 0,
    kill_bound_ms: Annotated[float, typer.Option(help="a kill whose daemon exits later than "
                                                      "this failed")] = 5000.0,
    max_kill_p99_ms: Annotated[float | None, typer.Option(
        help="fail when kill → daemon exited p99 is over this")] = None,
    killers_apart: Annotated[bool, typer.Option(
        "--killers-apart/--killers-with-operators",
        help="the killers in a Locust process of their own, so that the switch is not timed "
             "through the operators' event loop (without workers only)")] = True,
    report_dir: Annotated[Path, typer.Option(help="where the reports go")] = Path("reports"),
    target_url: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_URL")] = None,
    target_email: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_EMAIL")] = None,
    target_password: Annotated[str | None, typer.Option(envvar="COVEY_TARGET_PASSWORD")]
        = None,
    puppet_port: Annotated[int | None, typer.Option(help="with --stack target: serve the "
                                                         "puppet model on this port")] = None,
) -> None:
    """Locust load on the control plane while killers pull agent switches: kill →
    acknowledged, → daemon exited and → task open as request type KILL. Exits 1 when a kill
    failed (the agent acted after the acknowledgement, its daemon did not exit 3, or it took
    longer than --kill-bound-ms), when a request failed, or when the p99 is over the gate."""
    if min(users, agents, killers, processes) < 0 or agents < 1 or killers < 1:
        raise typer.BadParameter("--agents and --killers must be at least 1, --users and "
                                 "--processes at least 0")
    try:
        _run_seconds(run_time)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-time") from None
    plan = LoadPlan(users=users, spawn_rate=spawn_rate, run_time=run_time,
                    processes=processes, killers=killers, kill_bound_ms=kill_bound_ms,
                    max_kill_p99_ms=max_kill_p99_ms, master_workers=master,
                    killers_apart=killers_apart)
    chosen = make_stack(stack, report_dir, target_url, target_email, target_password,
                        puppet_port)
    result = asyncio.run(_load(chosen, plan, agents, report_dir))
    show(result)
    raise typer.Exit(0 if result.passed else 1)


async def _load(stack: Stack, plan: LoadPlan, agents: int, report_dir: Path) -> LoadResult:
    with console.status(f"bringing the {stack.name} stack up") as status:
        async with stack.up() as endpoints:
            status.update(f"{agents} agents getting to work")
            fleet = await prepare_fleet(endpoints, agents)
            if plan.master_workers:
                # API tokens: never among the reports (CI keeps those as artifacts), and
                # readable by this user only from the moment the file exists.
                fd, name = tempfile.mkstemp(prefix="covey-load-worker-", suffix=".env")
                worker_env = Path(name)
                with os.fdopen(fd, "w") as out:
                    out.write("".join(f"{k}={v}\n" for k, v in
                                      load_environment(fleet, plan).items()))
                console.print(f"waiting for {plan.master_workers} worker(s): on each, with "
                              f"the variables of {worker_env}, run `locust -f "
                              "harness/load/locustfile.py --worker --master-host THIS_HOST`")
            status.update(f"Locust: {plan.users} users and {plan.killers} killer(s) for "
                          f"{plan.run_time}")
            result = await run_load(endpoints, fleet, plan, report_dir)
            status.update(f"tearing the {stack.name} stack down")
    return result


def show(result: LoadResult) -> None:
    table = Table(title=f"kill under load: {result.plan.users} users, {result.kills} kills, "
                        f"{result.requests_per_s} requests/s")
    for column in ("part", "count", "p50 ms", "p90 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part, p in result.parts_us.items():
        table.add_row(part, str(p["count"]), *(f"{p[k] / 1000:.1f}" for k in
                                                ("p50_us", "p90_us", "p99_us", "max_us")))
    console.print(table)
    console.print("percentiles above: the harness's one definition (HDR, as in every game "
                  "day's summary and the gate); Locust's HTML and CSV round the times and take "
                  "the upper middle sample for a median, so their KILL rows can differ",
                  highlight=False)
    for name, path in result.files.items():
        console.print(f"{name}: {path}")
    if result.passed:
        console.print("[green]every kill held[/green]")
    for problem in result.problems:
        console.print(f"[red]{problem}[/red]")


if __name__ == "__main__":
    app()
